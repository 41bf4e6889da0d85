package middleware

import (
	"cmp"
	"context"
	"database/sql"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/internal/envelope"
)

// Outcomes counted by millrace_consumer_messages_total.
const (
	OutcomeOK          = "ok"           // the handler committed; the message was acked
	OutcomeDuplicate   = "duplicate"    // the inbox had the event id; acked without calling the handler
	OutcomeStale       = "stale"        // the ordering guard dropped an old aggregate version; acked
	OutcomeOtherType   = "other_type"   // not a type the handler takes (Handler.Takes); acked without an attempt
	OutcomePoisoned    = "poisoned"     // stored in the poison destination; acked
	OutcomeRetried     = "retried"      // one failed attempt that is retried (counted per attempt)
	OutcomeNacked      = "nacked"       // returned to the broker for redelivery (shutdown, poison store down)
	OutcomeNotTargeted = "not_targeted" // a replay for other consumer groups (ReplayGroupsKey); acked without the handler or an inbox row
)

// delivery is what the chain knows about one message while it processes it.
// The goroutine running the chain for the message owns it, so it has no
// lock; the inner part of an attempt (inbox transaction and handler), which
// runs in a goroutine of its own, never sees it (see attemptState).
type delivery struct {
	eventID string
	// attempts counts the times the handler stage was entered.
	attempts     int
	firstFailure time.Time
	lastFailure  time.Time
	// held is the time spent waiting for the breaker; max_elapsed excludes it.
	held time.Duration
	// finalErr is the error the chain gave up with, for the failure envelope.
	finalErr error
	outcome  string
}

func (d *delivery) failed(err error, now time.Time) {
	if d.firstFailure.IsZero() {
		d.firstFailure = now
	}
	d.lastFailure = now
	d.finalErr = err
}

// attemptState is what the inner part of one attempt (inbox transaction and
// handler) reads and reports. The attempt stage gives each attempt a fresh
// one and merges it into the delivery only when the attempt returned within
// handler_timeout, so that an abandoned attempt still running shares no
// mutable state with the next attempt or with the poison queue.
type attemptState struct {
	eventID string
	// number is the attempt's number, 1 for the first (see Attempt).
	number int
	// outcome is OutcomeOK, OutcomeDuplicate or OutcomeStale once the
	// transaction stage acked the message, empty otherwise.
	outcome string
}

// inflight is one message on its way through the chain: the message and
// everything the stages know of it, passed down from stage to stage as a
// value rather than in the message's context. The goroutine running the
// chain for the message owns it. The attempt stage gives the inner part of
// each attempt (inbox transaction and handler), which runs in a goroutine
// of its own, an inflight of its own: a copy of the message, its own
// attemptState, and neither the delivery nor the worker.
type inflight struct {
	msg *message.Message
	// d is the delivery state, set by the observe stage; nil in the inner
	// part of an attempt.
	d *delivery
	// a is the state of the current attempt, set by the attempt stage in
	// the inner part's inflight.
	a *attemptState
	// lease is what the runtime that released the message knows of it:
	// its worker and delivery number. The zero Lease when none did, and in
	// the inner part of an attempt.
	lease Lease
	// tx is the inbox transaction, set by the transaction stage for the
	// handler; nil with the inbox and the ordering guard both off.
	tx Transaction
}

// step is the rest of the chain as a stage sees it.
type step func(m *inflight) error

// stage is one stage of the chain: it runs around the rest (next).
type stage func(next step) step

// handling is what a handler reads from its context (Tx, CurrentTx,
// Attempt): the one value the chain puts in a context, since a handler
// sees only its message.
type handling struct {
	tx      Transaction
	attempt int
}

type handlingKey struct{}

// withHandling returns ctx carrying the handler-facing values tx and
// attempt.
func withHandling(ctx context.Context, tx Transaction, attempt int) context.Context {
	return context.WithValue(ctx, handlingKey{}, handling{tx: tx, attempt: attempt})
}

func handlingFrom(ctx context.Context) handling {
	h, _ := ctx.Value(handlingKey{}).(handling)
	return h
}

// Attempt returns the number of the attempt at the message being handled:
// 1 for the first, 2 for the first retry, and so on; an attempt that failed
// while a dependency or the database was down counts too, though it does
// not use up retry.max_attempts. It counts the attempts of this delivery,
// or of every delivery when the broker schedules the retries (RetryAuto),
// starting from the broker's delivery count, which survives restarts. It
// is the count the poison-attempts key records. It returns 0 when ctx is
// not a handler's context.
func Attempt(ctx context.Context) int { return handlingFrom(ctx).attempt }

// Tx returns the database transaction of the message being handled: the one
// the inbox row was inserted in, committed by the chain after the handler
// returns nil and before the message is acked. Do the handler's business
// writes (and any bus.Publish of follow-up events) in it. It returns nil when
// ctx is not a handler's context or the inbox and the ordering guard are both
// off. Never commit or roll it back yourself.
func Tx(ctx context.Context) *sql.Tx {
	tx, _ := handlingFrom(ctx).tx.(*sql.Tx)
	return tx
}

// eventIDOf is the event id the inbox deduplicates on: the event-id header
// millrace sets, or, for messages written by plain Watermill, the message UUID.
func eventIDOf(msg *message.Message) string {
	return cmp.Or(msg.Metadata.Get(envelope.EventIDKey), msg.UUID)
}
