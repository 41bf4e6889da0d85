package middleware

import (
	"context"
	"database/sql"
)

// Transaction is the inbox transaction as the chain drives it: its own
// statements (the inbox insert, the ordering guard, a probe) through
// ExecContext, then Commit or Rollback. *sql.Tx is one, the default;
// Deps.BeginTx supplies another kind (a pgx transaction, for a service on
// pgxpool). Commit must return an error wrapping sql.ErrTxDone when the
// transaction was already committed or rolled back, and must not commit
// once the context the transaction was begun with has ended.
type Transaction interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	Commit() error
	Rollback() error
}

// CurrentTx returns the inbox transaction of the message being handled, as
// Deps.BeginTx (or DB.BeginTx) returned it; nil when ctx is not a handler's
// context or the inbox and the ordering guard are both off. Tx is the same
// for a *sql.Tx.
func CurrentTx(ctx context.Context) Transaction {
	return handlingFrom(ctx).tx
}

// begin begins the inbox transaction of one attempt, on ctx.
func (s *Stack) begin(ctx context.Context) (Transaction, error) {
	if s.beginTx != nil {
		return s.beginTx(ctx)
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	return tx, nil
}
