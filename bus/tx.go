package bus

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/millrace-io/millrace/middleware"
)

// ErrNoTx is what Tx and PgxTx panic with (wrapped, with the cause) when
// ctx holds no inbox transaction of the kind asked for. A handler that
// meets it has its message poisoned at once with that reason: retrying
// cannot give it a transaction.
var ErrNoTx = errors.New("millrace: no inbox transaction")

// Tx returns the transaction of the message a handler is processing: the
// one its inbox row was inserted in, committed by millrace after the handler
// returns nil and before the message is acked. Do the handler's business
// writes, and any Publish of follow-up events, in it. Never commit or roll
// it back yourself.
//
// It panics with an error wrapping ErrNoTx, naming the cause, when there is
// no such transaction: ctx is not a handler's context, the handler's inbox
// and ordering guard are both off (consumer.inbox.enabled,
// consumer.ordering_guard), or the Bus was opened with OpenPgx (use PgxTx).
// A handler that panics so is poisoned with that message at once.
func Tx(ctx context.Context) *sql.Tx {
	switch tx := middleware.CurrentTx(ctx).(type) {
	case *sql.Tx:
		return tx
	case *pgxInboxTx:
		panic(fmt.Errorf("%w for bus.Tx: the Bus was opened with bus.OpenPgx, so the handler's transaction is a pgx.Tx: use bus.PgxTx(ctx)", ErrNoTx))
	default:
		panic(noTx(ctx, "bus.Tx"))
	}
}

// PgxTx is Tx for a Bus opened with OpenPgx: the handler's inbox
// transaction as a pgx.Tx, for pgx and sqlc in pgx mode. It panics like Tx
// when there is none, and for a Bus opened with Open (use Tx).
func PgxTx(ctx context.Context) pgx.Tx {
	switch tx := middleware.CurrentTx(ctx).(type) {
	case *pgxInboxTx:
		return tx.tx
	case *sql.Tx:
		panic(fmt.Errorf("%w for bus.PgxTx: the Bus was opened with bus.Open on a *sql.DB, so the handler's transaction is a *sql.Tx: use bus.Tx(ctx), or open the Bus with bus.OpenPgx", ErrNoTx))
	default:
		panic(noTx(ctx, "bus.PgxTx"))
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

// noTxPanic turns a panic of Tx or PgxTx in a handler into a permanent
// error with its message; any other panic goes on.
func noTxPanic(err *error) {
	if p := recover(); p != nil {
		if e, ok := p.(error); ok && errors.Is(e, ErrNoTx) {
			*err = Permanent(e)
			return
		}
		panic(p)
	}
}
