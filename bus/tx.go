package bus

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"

	"github.com/millrace-io/millrace/middleware"
)

// ErrNoTx is what Tx panics with (wrapped, with the cause) when ctx holds
// no inbox transaction, or none of the type asked for. A handler that
// meets it has its message poisoned at once with that reason: retrying
// cannot give it a transaction.
var ErrNoTx = errors.New("millrace: no inbox transaction")

// Tx returns the transaction of the message a handler is processing, as T:
// the one its inbox row was inserted in, committed by millrace after the
// handler returns nil and before the message is acked. Do the handler's
// business writes, and any Publish of follow-up events, in it. Never commit
// or roll it back yourself. T is
//
//   - *sql.Tx on a Bus opened on a *sql.DB, pgx.Tx on one opened on a
//     *pgxpool.Pool;
//   - Execer on either, what Publish and Schedule take:
//     b.Publish(ctx, bus.Tx[bus.Execer](ctx), topic, ev);
//   - any interface the transaction satisfies, such as sqlc's DBTX for
//     database/sql or for pgx.
//
// It panics with an error wrapping ErrNoTx, naming the cause, when there is
// no such transaction: ctx is not a handler's context, the handler's inbox
// and ordering guard are both off (consumer.inbox.enabled,
// consumer.ordering_guard), or the transaction is not a T (a *sql.Tx asked
// of a Bus on a *pgxpool.Pool, say). A handler that panics so is poisoned
// with that message at once.
func Tx[T any](ctx context.Context) T {
	fn := "bus.Tx[" + reflect.TypeFor[T]().String() + "]"
	switch tx := middleware.CurrentTx(ctx).(type) {
	case *sql.Tx:
		if t, ok := any(tx).(T); ok {
			return t
		}
		panic(fmt.Errorf("%w for %s: the Bus was opened on a *sql.DB, so the handler's transaction is a *sql.Tx: "+
			"use bus.Tx[*sql.Tx](ctx), or bus.Tx[bus.Execer](ctx) to publish", ErrNoTx, fn))
	case *pgxInboxTx:
		if t, ok := any(tx.tx).(T); ok {
			return t
		}
		if t, ok := tx.Execer.(T); ok {
			return t
		}
		panic(fmt.Errorf("%w for %s: the Bus was opened on a *pgxpool.Pool, so the handler's transaction is a pgx.Tx: "+
			"use bus.Tx[pgx.Tx](ctx), or bus.Tx[bus.Execer](ctx) to publish", ErrNoTx, fn))
	default:
		panic(noTx(ctx, fn))
	}
}

// noTx says why ctx has no inbox transaction at all.
func noTx(ctx context.Context, fn string) error {
	if ev, ok := incomingEvent(ctx); ok {
		return fmt.Errorf("%w for %s while handling event %s: the handler runs without one because its consumer.inbox.enabled "+
			"and consumer.ordering_guard are both false; turn the inbox on, or write outside millrace's transaction", ErrNoTx, fn, ev.ID)
	}
	return fmt.Errorf("%w for %s: ctx is not the context of a handler millrace is running (or one derived from it)", ErrNoTx, fn)
}

// noTxPanic turns a panic of Tx in a handler into a permanent error with
// its message; any other panic goes on.
func noTxPanic(err *error) {
	if p := recover(); p != nil {
		if e, ok := p.(error); ok && errors.Is(e, ErrNoTx) {
			*err = Permanent(e)
			return
		}
		panic(p)
	}
}
