package store

import (
	"context"
	"database/sql"
)

// SQLRowQuerier is a *sql.Tx or *sql.DB as a RowQuerier.
type SQLRowQuerier struct {
	DB interface {
		QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	}
}

// QueryRow runs query on q.DB.
func (q SQLRowQuerier) QueryRow(ctx context.Context, query string, args ...any) Row {
	return q.DB.QueryRowContext(ctx, query, args...)
}
