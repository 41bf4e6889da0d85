// Package store owns millrace's PostgreSQL tables: their names, their DDL
// (Migrate), the grants a service role needs (Grants), and every query on
// them. The relay (forwarder), the consumer chain (middleware), the public
// API and operations (bus), the command-line tool and millracetest call it;
// none of them writes SQL against a millrace table itself, which a test of
// this package checks over the whole tree.
//
// The outbox and offsets tables keep exactly the layout of watermill-sql's
// DefaultPostgreSQLSchema and DefaultPostgreSQLOffsetsAdapter, so rows
// written by plain Watermill land in, and are relayed from, the same table.
//
// Functions take a DBTX: a *sql.DB, *sql.Tx or *sql.Conn, so each runs in
// the transaction its caller holds, if any. The outbox write, the scheduled
// events' statements and the inbox statements need only an Execer, which a
// pgx.Tx is through Pgx: one code path for both drivers.
//
// Every statement works in each of pgx's query exec modes, the exec and
// simple_protocol modes a pooler in transaction mode calls for included.
// Those modes encode an argument by its Go type, not by the type of the
// parameter in the statement: a JSON or JSONB column gets a string, never a
// []byte (which they send as bytea); a BYTEA column gets a []byte; a
// time.Time goes to a TIMESTAMPTZ column (a TIMESTAMP one would ignore the
// zone of the text they send).
package store

import (
	"context"
	"database/sql"
)

// DBTX is what queries run on: a pool, a transaction or a connection.
type DBTX interface {
	Execer
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Execer runs statements that return no rows: a DBTX, or the consumer
// chain's inbox transaction whatever its driver.
type Execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}
