// Package millracetest runs a service's own bus.HandlerFunc through the
// failure modes at-least-once delivery produces (duplicates, a crash after
// the commit and before the ack, a crash before the commit, a failed commit,
// concurrent copies, reordering) and checks that each event has exactly one
// business effect.
//
// The name follows the standard library's convention for test helpers of a
// package's users (net/http/httptest, testing/fstest, testing/iotest): it is
// the test side of millrace as a whole, bus and middleware together, so it
// sits at the top level rather than under either.
//
// # What is real and what is simulated
//
// The consumer chain is the real one: bus.Bus.ConsumerChain builds exactly
// what bus.Run gives a handler registered with bus.Handle (poison queue,
// retry, circuit breaker, the inbox transaction that bus.Tx returns, the
// ordering guard, envelope decoding, causation of follow-up events), from
// the service's consumer configuration, on the test's PostgreSQL. Events are
// written with bus.Publish and read back from the outbox as the relay reads
// them (in a transaction that is then rolled back, so the outbox keeps
// nothing): the handler receives what a broker would deliver.
//
// The broker is replaced by a deterministic driver: each method delivers in
// one exact pattern, so a test fails or passes the same way every run.
// Consumer processes are simulated too: a crash ends the goroutine handling
// the delivery where the pattern says (the chain's deferred rollback undoes
// the transaction, as PostgreSQL does for a dead connection; nothing is
// acked), and the redelivery goes to a new chain, as after a restart. The
// Dispatcher (consumer.workers, ordered, prefetch) and the broker adapters
// are not exercised; their own tests cover them.
//
// # Use
//
//	func TestBillingIsIdempotent(t *testing.T) {
//		db := openTestDB(t) // the service's test database
//		h := millracetest.New(t, millracetest.Options{
//			DB: db, Topic: "orders.events", Group: "billing", Handler: billing.Handle,
//		})
//		ev := bus.Event{Type: "OrderPlaced", AggregateType: "order", AggregateID: "o-1", Payload: body}
//		h.Deliver(ev)
//		h.DeliverTwice(ev)
//		h.CrashAfterEffectBeforeAck(ev)
//		h.CrashBeforeCommit(ev)
//		h.FailCommitOnce(ev)
//		h.DeliverConcurrently(ev, 3)
//		h.AssertOnce(func(ctx context.Context, tx *sql.Tx, ev bus.Event) (int, error) {
//			var n int
//			err := tx.QueryRowContext(ctx, `SELECT count(*) FROM invoices WHERE order_event_id = $1`, ev.ID).Scan(&n)
//			return n, err
//		})
//	}
//
// Each method publishes the events it is given, so an event without an ID
// gets a new one each time and each call above tests a new event. The
// methods return the events with their ids; passing one back (or setting
// Event.ID) delivers the same event again, which the inbox then finds.
//
// # Patterns
//
//   - Deliver: once each, in order; a nacked delivery is delivered again.
//   - DeliverTwice: the same message again after the first was acked.
//   - CrashAfterEffectBeforeAck: the transaction commits, the ack is lost,
//     a restarted process gets the message again.
//   - CrashBeforeCommit: the handler runs to its end, the process dies
//     before the commit, a restarted process gets the message again.
//   - FailCommitOnce: the commit after the handler's first run fails; the
//     chain retries in the same process.
//   - DeliverConcurrently: copies handled by several processes at once.
//   - Reorder: later events first; with consumer.ordering_guard on, older
//     versions are dropped as stale.
//
// # What a failure says
//
// A handler whose effects are all in bus.Tx passes every pattern. One
// that writes on its own connection, calls another service or sends a
// message directly passes Deliver, DeliverTwice and CrashAfterEffectBeforeAck
// (the inbox absorbs those) and fails CrashBeforeCommit and FailCommitOnce:
// the run that was rolled back left its outside effect behind. AssertOnce
// then lists the event's deliveries and says so:
//
//	millracetest: event ord-1-placed (OrderPlaced of order ord-1): 2 effects, want exactly 1
//	    delivery 1 (CrashBeforeCommit, process 1: the process dies when the handler returns, before the commit): crashed, handler ran 1 time, not acked
//	    delivery 2 (CrashBeforeCommit, process 2: redelivered to the restarted process): ok, handler ran 1 time, acked
//	    The handler ran 2 times: 1 run committed, 1 was rolled back, undoing what it wrote in bus.Tx.
//	    Yet 2 effects remain, so the handler has effects outside bus.Tx (...) that no rollback undoes. ...
//
// It also explains a count of zero: a poisoned event (with the stored
// reason), a stale one, an inbox that already held the event.
//
// # Timing
//
// Unless Options.RealTimings is set, retry waits are 1ms and the breaker's
// open timeout 10ms, so a handler that keeps failing is poisoned after
// retry.max_attempts in milliseconds. Nothing in the harness waits on a clock
// to decide an outcome.
package millracetest
