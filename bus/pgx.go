package bus

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/middleware"
)

// Pgx is tx as an Execer, for Publish, Schedule and CancelScheduled (and
// the Topic ones) in a pgx transaction, begun on a pgxpool.Pool or a
// pgx.Conn: b.Publish(ctx, bus.Pgx(tx), topic, ev). Its statements go to
// tx.Exec, so they run in the query exec mode of tx's connection, and write
// byte for byte what they write on a *sql.Tx. A transaction already
// committed or rolled back yields an error wrapping pgx.ErrTxClosed.
// Pgx(nil) is nil, which Publish refuses with ErrNilTx.
func Pgx(tx pgx.Tx) Execer {
	if tx == nil {
		return nil
	}
	return store.Pgx(tx)
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
	return &pgxInboxTx{Execer: store.Pgx(tx), tx: tx, ctx: ctx}, nil
}

// pgxInboxTx is a pgx transaction as the consumer chain drives it.
type pgxInboxTx struct {
	Execer
	tx pgx.Tx
	// ctx is the attempt's: a Commit after handler_timeout is refused by
	// pgx before it sends COMMIT.
	ctx context.Context
}

func (t *pgxInboxTx) Commit() error {
	err := t.tx.Commit(t.ctx)
	if errors.Is(err, pgx.ErrTxClosed) {
		return fmt.Errorf("%w: %w", sql.ErrTxDone, err)
	}
	return err
}

func (t *pgxInboxTx) Rollback() error { return t.tx.Rollback(t.ctx) }

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
		"or pass bus.Open a *pgxpool.Pool", db.Driver())
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
