package wal

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// queryRow runs query (simple protocol, no parameters: every name in it
// is validated and quoted) and returns its first row, or errNoRows.
func queryRow(ctx context.Context, conn *pgconn.PgConn, query string) ([][]byte, error) {
	results, err := conn.Exec(ctx, query).ReadAll()
	if err != nil {
		return nil, err
	}
	if len(results) == 0 || len(results[0].Rows) == 0 {
		return nil, errNoRows
	}
	return results[0].Rows[0], nil
}

// errNoRows is queryRow's error for a query that returned no row.
var errNoRows = errors.New("no rows")

// exec runs statement (simple protocol).
func exec(ctx context.Context, conn *pgconn.PgConn, statement string) error {
	_, err := conn.Exec(ctx, statement).ReadAll()
	return err
}

// quoteIdent quotes name as an SQL identifier.
func quoteIdent(name string) string {
	return `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
}

// quoteLiteral quotes s as an SQL string literal (standard_conforming_strings).
func quoteLiteral(s string) string {
	return `'` + strings.ReplaceAll(s, `'`, `''`) + `'`
}

// sqlState is err's SQLSTATE, or "".
func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// closeConn closes conn, waiting a few seconds at most.
func closeConn(conn *pgconn.PgConn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}
