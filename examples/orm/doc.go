// Package orm shows how a handler and a publisher reach millrace's
// transaction from the data-access libraries Go services use: GORM, and
// sqlc in its database/sql and pgx modes. Its examples run against the
// local PostgreSQL. bun and ent work the same way as GORM, on the *sql.Tx:
// see "Your ORM and millrace's transaction" in docs/EVENTS.md.
package orm

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Queries is the shape sqlc generates in its database/sql mode
// (sql_package: database/sql) for one query,
//
//	-- name: CreateInvoice :exec
//	INSERT INTO invoices (order_id, event_id) VALUES ($1, $2);
//
// written out here so that the example compiles without running sqlc.
type Queries struct{ db DBTX }

// DBTX is what sqlc's database/sql mode runs queries on: *sql.DB or *sql.Tx.
type DBTX interface {
	ExecContext(context.Context, string, ...any) (sql.Result, error)
}

// New returns Queries on db.
func New(db DBTX) *Queries { return &Queries{db: db} }

// WithTx returns Queries on tx, such as bus.Tx[*sql.Tx](ctx).
func (q *Queries) WithTx(tx *sql.Tx) *Queries { return &Queries{db: tx} }

// CreateInvoice inserts an invoice.
func (q *Queries) CreateInvoice(ctx context.Context, orderID, eventID string) error {
	_, err := q.db.ExecContext(ctx, `INSERT INTO invoices (order_id, event_id) VALUES ($1, $2)`, orderID, eventID)
	return err
}

// PgxQueries is the same query as sqlc's pgx mode (sql_package: pgx/v5)
// generates it.
type PgxQueries struct{ db PgxDBTX }

// PgxDBTX is what sqlc's pgx mode runs queries on: *pgxpool.Pool, *pgx.Conn
// or pgx.Tx.
type PgxDBTX interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}

// NewPgx returns PgxQueries on db.
func NewPgx(db PgxDBTX) *PgxQueries { return &PgxQueries{db: db} }

// WithTx returns PgxQueries on tx, such as bus.Tx[pgx.Tx](ctx).
func (q *PgxQueries) WithTx(tx pgx.Tx) *PgxQueries { return &PgxQueries{db: tx} }

// CreateInvoice inserts an invoice.
func (q *PgxQueries) CreateInvoice(ctx context.Context, orderID, eventID string) error {
	_, err := q.db.Exec(ctx, `INSERT INTO invoices (order_id, event_id) VALUES ($1, $2)`, orderID, eventID)
	return err
}
