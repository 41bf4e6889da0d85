package bus

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/millrace-io/millrace/middleware"
)

// OpenPgx is Open for a service on pgxpool. Handlers get their inbox
// transaction from pool, as a pgx.Tx (PgxTx), and PublishPgx writes in the
// caller's pgx.Tx. The relay, the poison table and the other statements
// millrace runs on its own use a database/sql pool of their own, opened
// through pgx's stdlib with pool's connection config and closed by Close:
// a connection released to a pgxpool keeps its session state, and the
// relay's session lock and LISTEN must end with the connection that holds
// them. Close does not close pool.
func OpenPgx(ctx context.Context, cfg Config, pool *pgxpool.Pool, opts ...Option) (*Bus, error) {
	if pool == nil {
		return nil, errors.New("millrace: OpenPgx needs a *pgxpool.Pool; use Open for a *sql.DB")
	}
	cfg, err := cfg.check()
	if err != nil {
		return nil, err
	}
	b, err := open(ctx, cfg, stdlib.OpenDB(*pool.Config().ConnConfig), true, opts)
	if err != nil {
		return nil, err
	}
	b.pool = pool
	return b, nil
}

// MigratePgx is Migrate for a service on pgxpool: it runs on one of pool's
// connections, in one transaction.
func MigratePgx(ctx context.Context, pool *pgxpool.Pool, cfg Config) error {
	if pool == nil {
		return errors.New("millrace: MigratePgx needs a *pgxpool.Pool; use Migrate for a *sql.DB")
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	return Migrate(ctx, db, cfg)
}

// PublishPgx is Publish in a pgx transaction (begun on a pgxpool.Pool or a
// pgx.Conn), for any Bus. It writes exactly the rows Publish writes, with
// the same checks: on any error nothing is written. A transaction already
// committed or rolled back yields an error wrapping pgx.ErrTxClosed.
func (b *Bus) PublishPgx(ctx context.Context, tx pgx.Tx, topic string, events ...Event) error {
	if tx == nil {
		return ErrNilTx
	}
	rows, _, err := b.outboxRows(ctx, topic, events)
	if err != nil || len(rows) == 0 {
		return err
	}
	if err := b.tables.WriteOutboxPgx(ctx, tx, rows); err != nil {
		return fmt.Errorf("millrace: %w", err)
	}
	return nil
}

// beginPgx begins an attempt's inbox transaction on the pool. Its BEGIN
// also sets idle_in_transaction_session_timeout to what is left of the
// attempt: pgx does not roll a transaction back when its context ends (as
// database/sql does), so the server ends the transaction of an attempt
// abandoned at handler_timeout, and the locks it holds (its inbox row), once
// the attempt's time is up, not when its goroutine returns.
func (b *Bus) beginPgx(ctx context.Context) (middleware.Transaction, error) {
	opts := pgx.TxOptions{}
	if deadline, ok := ctx.Deadline(); ok {
		ms := max(time.Until(deadline).Milliseconds(), 1) + 1000 // a commit at the deadline lands first
		opts.BeginQuery = "BEGIN; SET LOCAL idle_in_transaction_session_timeout = " + strconv.FormatInt(ms, 10)
	}
	tx, err := b.pool.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &pgxInboxTx{tx: tx, ctx: ctx}, nil
}

// pgxInboxTx is a pgx transaction as the consumer chain drives it.
type pgxInboxTx struct {
	tx pgx.Tx
	// ctx is the attempt's: a Commit after handler_timeout is refused by
	// pgx before it sends COMMIT.
	ctx context.Context
}

func (t *pgxInboxTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	tag, err := t.tx.Exec(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return rowsAffected(tag.RowsAffected()), nil
}

func (t *pgxInboxTx) Commit() error {
	err := t.tx.Commit(t.ctx)
	if errors.Is(err, pgx.ErrTxClosed) {
		return fmt.Errorf("%w: %w", sql.ErrTxDone, err)
	}
	return err
}

func (t *pgxInboxTx) Rollback() error { return t.tx.Rollback(t.ctx) }

// rowsAffected is the sql.Result of a pgx statement.
type rowsAffected int64

func (n rowsAffected) RowsAffected() (int64, error) { return int64(n), nil }

func (rowsAffected) LastInsertId() (int64, error) {
	return 0, errors.New("millrace: PostgreSQL has no last insert id; use RETURNING")
}

// checkDriver refuses a *sql.DB whose driver is not pgx/v5's stdlib: the
// relay LISTENs through the pgx connection and errors are classified by
// pgconn's types, so another driver would fail only once Run starts. A
// driver that wraps pgx's (for tracing, say) passes when its connections
// expose the pgx connection the way stdlib's do.
func checkDriver(ctx context.Context, db *sql.DB) error {
	if _, ok := db.Driver().(*stdlib.Driver); ok {
		return nil
	}
	refused := fmt.Errorf("millrace: the *sql.DB uses the database/sql driver %T, not pgx/v5's: "+
		`import _ "github.com/jackc/pgx/v5/stdlib" and open it with sql.Open("pgx", url) (or bus.OpenDB), `+
		"or use bus.OpenPgx with a *pgxpool.Pool", db.Driver())
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("%w (could not connect to check whether it wraps pgx's: %v)", refused, err)
	}
	defer conn.Close()
	return conn.Raw(func(dc any) error {
		if _, ok := dc.(interface{ Conn() *pgx.Conn }); ok {
			return nil
		}
		return refused
	})
}
