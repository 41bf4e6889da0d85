// Package middleware is millrace's consumer chain: the stages every
// handler runs in (poison queue, jittered retry, circuit breaker, inbox in
// the handler's transaction, ordering guard) and their configuration (the
// consumer section of config.yaml). Package consumer, below it, is the
// runtime that feeds a chain from a broker (the Dispatcher); this package
// knows no broker.
//
// This comment describes what the chain does and why. README.md next to it
// holds what a doc comment cannot: the per-broker tables (where a message
// waits between attempts, concurrency and ordering), the configuration and
// metrics tables, the tests and measurements behind the breaker's and group
// commit's rules, and notes for broker adapters.
//
// # Use
//
// New builds a Stack from the consumer Config and the service's database,
// metrics registry and logger. Stack.Check checks that the tables exist
// (run `millrace migrate` first) and Stack.RunRetention prunes the inbox
// every inbox.cleanup_interval. Stack.Chain builds the chain of one handler
// (name, topic, consumer group) with that handler's settings, defaults
// merged with its override under consumer.handlers. Give it to Watermill's
// router:
//
//	stack, err := middleware.New(cfg.Consumer, middleware.Deps{DB: db, Schema: "public", Registerer: reg, Logger: logger})
//	err = stack.Check(ctx)     // the tables exist (run `millrace migrate` first)
//	go stack.RunRetention(ctx) // prunes the inbox every inbox.cleanup_interval
//
//	chain, err := stack.Chain(middleware.Handler{Name: "billing", Topic: "orders.events", ConsumerGroup: "billing"})
//	router.AddConsumerHandler("billing", "orders.events",
//		consumer.Subscriber(chain, consumer.Source{NewSubscriber: newSubscriber, Competing: true}),
//		chain.Wrap(func(msg *message.Message) error {
//			var o Order
//			if err := middleware.DecodeJSON(msg, &o); err != nil {
//				return err // permanent: poisoned at once, naming the field
//			}
//			_, err := middleware.Tx(msg.Context()).ExecContext(msg.Context(), `INSERT INTO invoices ...`)
//			return err // nil: commit, then ack; an error: rolled back and retried
//		}))
//
// The handler finds the transaction of its message with Tx(msg.Context()) and
// does its business writes in it. It returns nil to commit and ack, a
// Permanent (or Invalid, or DecodeJSON's) error to poison the message at once,
// and any other error to have it retried.
//
// # Outcomes
//
// What becomes of a message, by what the handler returns, with the outcome
// counted in millrace_consumer_messages_total:
//
//   - nil: the transaction (inbox row and business writes) commits, then
//     the message is acked (ok).
//   - The event id is in the inbox already: acked without calling the
//     handler (duplicate).
//   - With the ordering guard, an aggregate version not newer than the
//     applied one: acked without calling the handler (stale).
//   - Not called: a message the handler does not take (Handler.Takes says
//     no: an event of a type a typed handler has no route for) is acked at
//     once, before any attempt, with no inbox row and no transaction
//     (other_type).
//   - Permanent(err), Invalid(...), DecodeJSON's error, CheckSchemaVersion's
//     error: rolled back, poisoned at once with its failure envelope, acked
//     (poisoned).
//   - Any other error, or a panic: rolled back, retried with backoff; after
//     retry.max_attempts or retry.max_elapsed, poisoned.
//   - Nothing within handler_timeout (the handler ignores its context: a
//     stuck driver call, a sleep): the attempt is abandoned, a failed
//     attempt, retried and poisoned after retry.max_attempts (or
//     retry.max_elapsed) with the reason "attempt abandoned after
//     handler_timeout (…)"; rolled back; the worker takes the next message;
//     the handler's goroutine is left to finish (see "A handler that ignores
//     its context" below).
//   - Anything, while the consumer stops: a running attempt goes on; it
//     commits and is acked, or it fails or is abandoned at handler_timeout
//     and is nacked; waiting messages are nacked; nacked messages are
//     redelivered (nacked), never poisoned.
//   - A replay for other consumer groups (ReplayGroupsKey): acked without
//     an attempt (not_targeted). A retried attempt counts retried.
//
// IsRetryable(err) is the one classification the whole chain uses: nil and
// permanent errors are not retryable, everything else is.
//
// Bad input is refused before any attempt, as a permanent *InvalidError whose
// reason names the field: no event id (metadata.event-id), an event id over
// 128 bytes, metadata over consumer.max_metadata_bytes (metadata), a
// content-type: application/json payload that is not JSON (payload), and,
// with the ordering guard, an aggregate-version that is not a non-negative
// integer. A payload of the wrong shape is payload.<field> through
// DecodeJSON; an unknown schema version is metadata.schema-version through
// CheckSchemaVersion.
//
// # The chain, outermost first
//
// Chain.Wrap builds it. Each stage takes the rest of the chain and the
// message's state as one explicit value (the message, its delivery, the
// current attempt, its worker and its transaction), not as context values,
// so they only work together and are not exported one by one. Wrap is the
// one place the chain meets Watermill's HandlerFunc, and the handler's
// context carries the one value a handler reads: its transaction and
// attempt number (Tx, CurrentTx, Attempt).
//
//  1. observe: gives the message its delivery state and counts the outcome
//     (ok, duplicate, stale, other_type, parked, skipped, poisoned, nacked, not_targeted). Outermost,
//     so it sees the final verdict of everything below.
//  2. target: a replay for other consumer groups (ReplayGroupsKey) is
//     acked here, counted not_targeted, before anything below can process,
//     poison or record it (before the poison queue, the validation and the
//     inbox); the one place the rule is applied, for every kind of handler
//     on every broker.
//  3. Watermill's Recoverer: a panic in the chain's own code becomes an error,
//     so the message is nacked, never acked by accident nor lost in a crash.
//     With Handler.Takes set, a message the handler does not take (an event
//     of a type a typed handler has no route for) is acked here, before any
//     attempt or inbox row, and counted as other_type: it is not the
//     handler's, so it is neither validated nor poisoned. With
//     poison.park, a message of a parked order key is appended to its
//     parked list and acked here, counted as parked (see Parked
//     aggregates).
//  4. Watermill's PoisonQueueWithFilter, with millrace's publisher: outside the
//     retry, so that it sees a message only once its retries are spent.
//     Watermill issues #645 and #580 are this trap: with
//     router.AddMiddleware(Retry, PoisonQueue) the poison queue is inside
//     the retry (the first middleware added is the outermost), takes the
//     first failure, and the retry never runs. Its filter
//     takes permanent errors and spent retries only, never a stop, an open
//     breaker or an outage. The publisher adds the failure envelope and
//     stores the message in the poison table or publishes it to the poison
//     topic; if that fails it keeps the message and tries again (a stop nacks
//     it), so a message is never acked unstored.
//  5. validate: a message that can never be processed (no event id, metadata
//     over consumer.max_metadata_bytes, a JSON content type with a payload
//     that is not JSON, a malformed aggregate-version) is a permanent
//     *InvalidError naming the field. Inside the poison queue so that it is
//     quarantined; outside the retry since retrying cannot fix it.
//  6. retry: exponential backoff with jitter (cenkalti/backoff intervals).
//     Permanent errors skip it; a stop ends its waits with a nack. When the
//     broker schedules redeliveries (NATS, RabbitMQ; Kafka with retry topics) and
//     the handler is unordered, the waits are the broker's: a failed
//     attempt is nacked, redelivered after RedeliveryWait, and the attempt
//     number is the broker's delivery count (README.md: "Where a message
//     waits between attempts, per broker"). Outside the
//     breaker, so that waiting for the breaker is not mistaken for a failed
//     attempt, and a failure the breaker attributes to an outage does not use
//     up the message's attempts. Each attempt gets a fresh context (Watermill
//     issue #467: Watermill's Timeout leaves its cancelled context on the
//     message, and the next attempt of its Retry starts already cancelled).
//  7. breaker: one sony/gobreaker breaker per handler. It opens when
//     breaker.consecutive_failures different messages failed their first
//     attempt with no attempt succeeding since (see Outages below). While it
//     is open the message waits and the handler is not called; since a
//     subscription delivers its next message only after the current one is
//     acked, the handler's intake pauses. After breaker.open_timeout, trial
//     attempts run, taken by messages that have not failed yet when any
//     wait. Inside the retry, so that it sees every attempt; outside the
//     inbox, so that a database outage opens it too; outside the timeout, so
//     that waiting while open is not cut short.
//  8. attempt: bounds one attempt by handler_timeout, on a context a stop
//     does not cancel (context.WithoutCancel): an attempt that started
//     finishes and commits rather than being torn down halfway. The inner
//     part (stages 9 and 10 and the handler) runs in a goroutine of its own,
//     on a copy of the message and with state of its own. At
//     handler_timeout the stage stops waiting for it and the attempt is
//     abandoned (see "A handler that ignores its context" below).
//  9. transaction: the inbox. One database transaction inserts
//     (consumer_group, event_id) into millrace_inbox first (ON CONFLICT DO
//     NOTHING; a concurrent duplicate waits on the row lock), applies the
//     ordering guard when on, runs the handler with the transaction in its
//     context, and commits; the router acks only after the commit. A
//     duplicate is acked without calling the handler; an error rolls back
//     the inbox row with everything else. With consumer.batch.max_messages
//     above 1 (group commit, below), messages in flight share one
//     transaction, each in a savepoint of its own that a failure or panic
//     rolls back alone; each is acked after the one COMMIT. Chain.WrapBatch
//     takes a batch handler (BatchHandlerFunc) instead: each message's
//     savepoint holds its inbox insert and ordering guard, and the handler
//     runs once for the batch's new messages before the COMMIT.
//  10. Watermill's Recoverer again, around the handler: a panic in the
//     handler becomes a retryable error and the transaction rolls back.
//
// The retry, the breaker stage and the timeout are written here rather than
// taken from Watermill, each with a one-line reason in the code. Watermill's
// Retry advances its backoff once more for every ShouldRetry/OnRetryHook
// call, so the configured ladder is not the one you get, and it cannot keep
// an outage from using up attempts. Its CircuitBreaker fails fast while
// open, which the retry would turn into poisoned messages during an outage,
// and is on gobreaker v1. Its Timeout (issue #467) only cancels the
// context, so a handler that ignores it holds its worker. The backoff
// intervals are cenkalti/backoff's; the breaker state machine is
// sony/gobreaker's.
//
// Do not add Watermill's Retry, PoisonQueue, CircuitBreaker or Timeout
// as router-level middleware around the chain: it has its own, in the order
// above.
//
// The Watermill issues: [#645], [#580], [#467].
//
// # A handler that ignores its context
//
// handler_timeout ends the attempt's context, which stops every well-behaved
// call (database/sql, pgx, net/http with the context). A handler that blocks
// regardless (a driver call without a context, time.Sleep, a lock) is not
// waited for past that point. The attempt stage runs the inbox transaction
// and the handler in a goroutine of its own; at handler_timeout it stops
// waiting and:
//
//   - fails the attempt with a retryable error, "attempt abandoned after
//     handler_timeout (30s): ...". It is a failed attempt of that message:
//     the retry waits and tries again, and after retry.max_attempts the
//     message is poisoned with that reason (error_class transient, attempts
//     = retry.max_attempts), or earlier when the next attempt would pass
//     retry.max_elapsed: with the defaults (30s timeout, 1m) that is after
//     2 attempts, since an abandoned attempt's handler_timeout counts toward
//     retry.max_elapsed. Each abandoned attempt is counted in
//     millrace_consumer_abandoned_attempts_total.
//   - frees the worker: the Dispatcher releases the next message, and an
//     ordered handler's next message of that aggregate waits only for the
//     blocked message to be retried and poisoned (the other aggregates go
//     on until the held messages fill prefetch).
//   - rolls the transaction back. It was begun on the attempt's context, and
//     database/sql rolls a transaction back when its context ends; Commit
//     checks that context before it marks the transaction done, so the
//     handler, when it returns at last, cannot commit. The one late commit
//     possible is a COMMIT sent before the timeout that the server carries
//     out after it (pgx cancels it at the deadline, but it may be done
//     already, or waiting for a synchronous standby): its inbox row commits
//     with it, and the retry, whose inbox insert waits on that row's lock,
//     finds it and acks the message as a duplicate. One effect either way.
//   - leaves the goroutine to finish. It works on a copy of the message and
//     on state of its own, so it never races with the next attempt or the
//     poison queue (which writes the message's metadata); what it returns
//     is logged and dropped. millrace_consumer_abandoned_attempts_running
//     shows the abandoned attempts still running: a value that only grows
//     means handlers stuck for good, each holding its goroutine (and
//     whatever it blocks on).
//
// So a handler that ignores its context holds neither a worker nor a stop
// past handler_timeout. The circuit breaker counts the first abandoned
// attempt of a message as a failure (its later ones add nothing), so a
// dependency that hangs every call opens it once breaker.consecutive_failures
// messages hung, and is then tried once per breaker.open_timeout rather than
// by every worker, while a few hung messages among messages that succeed
// never open it; between its attempts a hung message holds no worker. It is
// never taken for an outage: it always uses up an attempt of its message,
// because each one may leave a goroutine behind, and a message held through
// an outage would start a new one at every trial. The price: while a
// dependency hangs every call (rather than failing), the trial messages are
// poisoned after retry.max_attempts trials each; replay them once it is
// back. A handler that honours its context and returns its error once
// handler_timeout has passed is treated the same way: a hang is a hang,
// whether or not the handler lets go of it.
//
// # Outages and bad messages
//
// The breaker opens when breaker.consecutive_failures (5) different
// messages failed their first attempt with no attempt of the handler
// succeeding since (a permanent error counts as a success: the dependency
// answered). Only a message's first failed attempt counts: a message
// failing again, or hanging again at handler_timeout, was blamed by its
// first failure already and tells nothing new about the dependency. So a
// few flaky or hung messages never open it while others succeed, however
// often they are retried, and a dependency that fails every message opens
// it after consecutive_failures of them. The first attempt is that of the
// first delivery: where the broker counts deliveries (NATS, RabbitMQ, Kafka
// with retry_topics) that holds across consumer restarts; Kafka's
// in-process count does not, so after a restart the messages that were
// failing are new to the breaker again.
//
// While it is open, a message waits in the breaker stage. One that failed
// before waits off its worker (the Dispatcher gives the worker to the next
// message meanwhile), one that has not holds its worker, so the handler's
// intake stops once every worker holds an untried message (and prefetch
// bounds the messages held in all). After open_timeout the half-open trial
// goes to an untried message when one waits: a message that failed before
// says nothing about the dependency, and trying it again would only reopen
// the breaker and hold the other messages back for another open_timeout.
//
// A retryable failure counts against the message unless the breaker is open
// and the failures since the last success came from more than one message:
// then it is an outage, the message waits for the breaker and its attempts
// are not used up (retry.max_elapsed does not run), however long the outage
// lasts, and nothing is poisoned. When one message alone keeps failing
// (every other message in flight succeeds, or it is the only one), it is a
// bad message: it is poisoned after retry.max_attempts even if its own
// failures opened the breaker, and the messages behind it flow again.
//
// With a single message in flight (one worker, or an ordered handler on
// NATS) the two cannot be told apart that way: an outage that outlasts a
// message's retries poisons the messages that find it one after the other
// (replay them once the dependency is back) until consecutive_failures of
// them failed, then the breaker opens and everything after waits. Return
// Permanent for errors known to be about the message, so that the breaker
// only ever counts dependency failures, and give such a handler a
// dependency probe.
//
// A dependency probe (Handler.Probe, a ProbeFunc; in bus,
// Handle(..., bus.WithDependencyProbe(probe))) is a check of the
// dependencies the handler calls, independent of any message (a health
// endpoint, SELECT 1 on the handler's own database): nil when they answer,
// an error when they do not. With one, the breaker stops guessing: after
// every retryable failure of an attempt it asks the probe, bounded by
// handler_timeout, before the retry stage counts the failure.
//
//   - The probe fails: the dependency's fault. The attempt is not counted
//     (nor is the wait in retry.max_elapsed); the breaker opens
//     (millrace_consumer_breaker_state 2) and no attempt of the handler runs
//     until the probe, asked once per breaker.open_timeout by one waiting
//     message, passes; then the message is tried again with its attempts
//     intact. An outage of any length poisons nothing and calls the handler
//     once (the attempt that found it).
//   - The probe passes: the message's fault. The failure is counted, even
//     when the breaker's guess would have said outage; the message is
//     poisoned after retry.max_attempts and the flow goes on.
//
// A probe needs breaker.enabled (a chain with a probe and the breaker off is
// refused, naming the key that turned it off). An abandoned attempt, a stop
// and millrace's own database unreachable are never put to the probe: they
// keep the rules above. On Kafka a held message's context ends when its
// consumer group session does (a member joins or leaves), so the breaker
// lets go of it (nacked, not counted) and the consumer rejoins the group in
// time however long the outage lasts.
//
// millrace's own database is told apart without the breaker: when the inbox
// transaction cannot begin, insert or commit because PostgreSQL cannot be
// reached (no answer, a broken connection, SQLSTATE class 08 or
// 57P01-57P03), or the handler failed and its transaction no longer
// answers, the message was never judged. The attempt is repeated after the
// backoff's next wait without using up a retry, for as long as the database
// stays away, and nothing is poisoned.
//
// With breaker.enabled false nothing tells an outage from a bad message: an
// outage longer than the retry ladder poisons the messages it catches (they
// are stored once the database answers again, and can be replayed).
//
// Holding a message has a limit set by the broker: NATS redelivers a message
// not acked within the consumer's AckWait, RabbitMQ closes a channel that
// keeps a delivery unacked past consumer_timeout (30 minutes by default).
// The redelivered copy is a duplicate the inbox absorbs.
//
// # Group commit
//
// With batch.max_messages above 1, the messages of a handler that reach the
// inbox stage within batch.max_wait of each other share one database
// transaction: a goroutine of the batch begins it, sets a SAVEPOINT for
// each message in the order they came, lets the message's attempt run its
// inbox insert, ordering guard and handler in it (Tx(ctx) is the batch's
// transaction), and sends one COMMIT for all. With the inbox on and the
// ordering guard off the inbox rows of the whole batch are inserted first,
// by one statement (ids sorted, so batches sharing ids lock their rows in
// one order), and a message's turn is its savepoint and its handler; when
// that statement adds fewer rows than the batch has messages (a duplicate
// among them) the transaction is rolled back and begun again with an
// insert in each turn, which tells which. Then:
//
//   - a handler that fails or panics has its savepoint rolled back (its
//     writes with it, and its inbox row, deleted when the batch inserted
//     it) and its message goes the usual retry/poison way; the others
//     commit together;
//   - every message is acked only after the COMMIT holding its effect
//     returned; a batch that cannot commit (database gone,
//     handler_timeout) commits nothing, and its messages are retried or
//     redelivered; the inbox absorbs what had landed after all;
//   - a batch runs at once when it is full, or when it holds every message
//     in the chain and no message left the chain within batch.max_wait
//     without a successor arriving (a subscription hands over its next
//     message a broker round trip after the ack, so right after a batch is
//     acked its successors are on their way: running on the first of them
//     made batches of 2-4 with 8 workers); at a trickle, or on an ordered
//     handler's single subscription, nothing waits; otherwise a batch waits
//     at most batch.max_wait from its first message;
//   - a batch is made of messages in flight, so workers caps it;
//   - order: an ordered handler has one message per aggregate in flight, so
//     a batch holds at most one per aggregate and the next is released only
//     after the batch's COMMIT and ack;
//   - a turn that takes longer than a tenth of handler_timeout sends the
//     messages not run yet to another batch, so a stuck handler delays only
//     the messages already waiting for its batch's COMMIT; a batch's
//     transaction ends at the earliest handler_timeout of its messages;
//   - when a statement fails in a way no message can be blamed for (a
//     handler swallowed an error of its own statement, or committed the
//     transaction itself), the messages whose savepoints were kept are each
//     tried again in a transaction of their own, which tells; the others
//     join another batch;
//   - batch.max_messages is at most 64: each message is a subtransaction,
//     and PostgreSQL caches 64 per transaction.
//
// A batch saves COMMITs and BEGINs but runs its messages one after another
// on one connection, so it pays where a COMMIT waits for a disk flush or a
// synchronous standby, and where a batch handler replaces per-message
// statements with one; hence the default of 1 (README.md, "When it pays",
// has the measurements).
//
// Chain.WrapBatch(h) (in bus: HandleBatch, Topic[T].HandleBatch) gives the
// handler the batch itself, for a bulk insert or one call to another
// service per batch. The batch forms as above; each message's savepoint
// holds only its inbox insert and ordering guard, so duplicates and stale
// versions are settled before the handler and never reach it; then the
// handler runs once, with the batch's transaction in Tx(ctx) and the
// messages in delivery order, and one COMMIT follows. What it returns
// decides:
//
//   - nil: the batch commits; every message is acked after the COMMIT.
//   - BatchFailures{eventID: err, ...}: the transaction rolls back; each
//     named message goes the retry/poison way with its error (Permanent:
//     poisoned at once), counted as one failed attempt of that message
//     only; the others are handed over again at once, without the failed
//     ones, and commit in a later batch (their attempts are not used up).
//   - BatchFailures naming an id not in the batch: a bug; every message of
//     the batch fails with *UnknownBatchMessageError naming the id
//     (retried, then poisoned with that reason).
//   - Any other error: the whole batch fails; every message is retried (or
//     poisoned when Permanent); a retryable error while the database is
//     unreachable holds the messages without using up their attempts, as
//     for one message.
//   - A panic (or runtime.Goexit): the batch's effects roll back and each
//     of its messages is tried again in a batch of its own, within the same
//     attempt: the one that panics is found and retried alone (poisoned at
//     retry.max_attempts), the others commit.
//
// Savepoints cannot separate one message's share of a bulk statement, hence
// the roll back and hand over again: the others' effects are committed
// once, but the handler sees them twice; a call to another service in it is
// not undone by the roll back (make it idempotent by event id, as anything
// outside the transaction must be). A whole-batch failure is a failed
// attempt of every message of it, for the retry ladder and for the breaker.
// The handler's context ends at the earliest handler_timeout of the batch's
// attempts; with batch.max_messages 1, or the inbox and the ordering guard
// both off, it is called with one message at a time. Order is as above: an
// ordered handler's batch holds at most one message per aggregate. With the
// inbox on and the ordering guard off, a batch whose messages are all new
// inserts their inbox rows with one statement and needs no savepoint per
// message; a batch with a duplicate among its messages is begun again with
// the savepoint per message, which tells which.
//
// # Inbox, ordering guard and poison destination
//
// The inbox is the table millrace_inbox (consumer_group, event_id,
// processed_at), primary key (consumer_group, event_id). Deduplication is
// per consumer group, so two handlers with the inbox on need two groups
// (Stack.Chain refuses a shared one). The event id is the event-id header
// millrace sets when the event is written to the outbox (or, for messages
// written by plain Watermill, the message UUID); it never changes across
// relay retries. Stack.PruneInbox (and Stack.RunRetention, which calls it
// every inbox.cleanup_interval) deletes rows older than inbox.retention in
// batches of inbox.cleanup_batch, skipping locked rows, so it never holds
// long locks; `millrace inbox purge` and the operations API do the same
// without a running consumer. README.md says how to size the retention.
//
// With ordering_guard true, the inbox transaction also upserts
// millrace_aggregate_versions (consumer_group, aggregate_type,
// aggregate_id) -> version and skips the handler (acking, counted as stale)
// when the event's aggregate-version is not newer than the stored one.
// Events without a version (0) or without an aggregate id pass. It suits
// events that carry state (the newest wins); for deltas, use ordered
// instead. Replaying a poisoned event after newer events of its aggregate
// were applied drops it as stale. These rows are one per aggregate and are
// not pruned.
//
// poison.destination table (the default) stores a poisoned message in
// millrace_poison, one row per (consumer group, handler, message id), with
// the message (message_id, event_id, event_type, payload as bytes,
// metadata as JSON) and the envelope in columns: reason, error_class
// (permanent or transient), attempts, first_failure_at, last_failure_at,
// source_topic, handler, consumer_group, traceparent, poisoned_at,
// times_poisoned and replayed_at for the CLI. Listing and replay work the
// same on every broker. `millrace dlq replay` re-sends a message with a new
// message id, the same event id, the event's own metadata (none of the
// broker's delivery headers), ReplayOfKey (replay-of) naming the original
// and ReplayGroupsKey (replay-groups) naming the consumer groups it is for:
// the chain of any other group acks it without calling the handler or
// writing an inbox row. If the replay is poisoned again it updates the
// original's row (times_poisoned + 1, replayed_at cleared); the replay's
// rules are explained in cmd/millrace/README.md.
// poison.destination topic publishes the message, its metadata and the
// envelope as metadata keys (PoisonReasonKey ... PoisonedAtKey, the reason
// cut to 2 KiB) to poison.topic with Deps.PoisonPublisher. A poisoned
// message is acked only once it is stored. If storing fails (database or
// broker down) the message is held and storing is retried with the retry
// ladder; a stop nacks it.
//
// # Parked aggregates
//
// A poisoned message left behind breaks the order of its aggregate: its
// later events are processed, and its replay lands after them (the
// ordering guard would drop it as stale). So with ordered true and
// poison.park (the default for ordered handlers with poison.destination
// table; false keeps the later events flowing past the poisoned one), the
// poison stage parks the message's order key (the aggregate-id header, or
// Handler.OrderKey's, such as a saga's correlation id) for the handler's
// consumer group, in the transaction that stores the poison row:
// millrace_parks gets (consumer_group, handler, order_key) held by the
// poison row, and millrace_parked the poisoned message itself, byte for
// byte, as the held head of the key's list. The park stage, between sift
// and the poison queue, appends every later message of a parked key to the
// list (one statement that locks the park row), acks it and counts it as
// parked (OutcomeParked); other keys flow on. A replay of the poison row
// (`millrace dlq replay`) or a skip (`millrace dlq skip`) only changes rows:
// the head stays first, or goes, and the park is released. consumer.Subscriber
// gives the Dispatcher one more input (Chain.Parked) that drains released parks: a
// consumer takes a park's lease (FOR UPDATE SKIP LOCKED; it outlives a
// killed holder by at most 5 s and is renewed while a message is in the
// chain), hands the list's messages, one at a time and in order, through
// the whole chain (inbox, retry, poison: one poisoned again parks the key
// again, at the head), deletes each once acked, and deletes the park under
// its row lock once the list is empty. A message of the key that arrives
// meanwhile is appended behind the others, so nothing overtakes. No broker
// round trip is involved, so it is the same on every broker and with batch
// handlers. A handling whose delete a crash lost is handed on again and
// the inbox absorbs it, as it absorbs a broker's redelivery; without the
// inbox it runs twice. A redelivery that arrives while the key is parked
// (an earlier message, or the poisoned one, whose ack a crash lost) is
// parked too, and absorbed the same way; a skip drops the poisoned
// message's copies with it, and a redelivery of a skipped message that
// comes later still is acked without the handler (OutcomeSkipped). millrace_consumer_parked_aggregates{handler} gauges
// the parks; the alert MillraceAggregatesParked fires when one stays.
//
// # The runtime
//
// Package consumer (middleware/consumer) is the runtime that feeds a
// chain: its Dispatcher subscribes to the broker, releases messages to
// Watermill's router with bounded concurrency and per-aggregate order,
// lends each its worker (Lease, Chain.Feed) and drains on a stop; its
// BrokerSource picks the broker's subscriber. It is the only part of the
// consumer side that knows the adapters: this package imports neither.
//
// [#645]: https://github.com/ThreeDotsLabs/watermill/issues/645
// [#580]: https://github.com/ThreeDotsLabs/watermill/issues/580
// [#467]: https://github.com/ThreeDotsLabs/watermill/issues/467
package middleware
