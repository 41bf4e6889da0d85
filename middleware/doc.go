// Package middleware is millrace's consumer side: the chain every handler
// runs in (poison queue, jittered retry, circuit breaker, inbox in the
// handler's transaction, ordering guard), the Dispatcher that feeds a handler
// with bounded concurrency and per-aggregate order, and their configuration
// (the consumer section of config.yaml).
//
// # Use
//
// New builds a Stack from the consumer Config and the service's database,
// metrics registry and logger. Stack.Chain builds the chain of one handler
// (name, topic, consumer group) with that handler's settings, defaults merged
// with its override under consumer.handlers. Give it to Watermill's router:
//
//	chain, _ := stack.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "billing"})
//	router.AddConsumerHandler("billing", "orders", chain.Subscriber(source), chain.Wrap(handle))
//
// The handler finds the transaction of its message with Tx(msg.Context()) and
// does its business writes in it. It returns nil to commit and ack, a
// Permanent (or Invalid, or DecodeJSON's) error to poison the message at once,
// and any other error to have it retried.
//
// # The chain, outermost first
//
//  1. observe: gives the message its delivery state and counts the outcome
//     (ok, duplicate, stale, other_type, poisoned, nacked, not_targeted). Outermost,
//     so it sees the final verdict of everything below.
//  2. target: a replay for other consumer groups (ReplayGroupsKey) is
//     acked here, counted not_targeted, before anything below can process,
//     poison or record it; the one place the rule is applied, for every
//     kind of handler on every broker.
//  3. Watermill's Recoverer: a panic in the chain's own code becomes an error,
//     so the message is nacked, never acked by accident nor lost in a crash.
//     With Handler.Takes set, a message the handler does not take (an event
//     of a type a typed handler has no route for) is acked here, before any
//     attempt or inbox row, and counted as other_type.
//  4. Watermill's PoisonQueueWithFilter, with millrace's publisher: outside the
//     retry, so that it sees a message only once its retries are spent
//     (Watermill issues #645 and #580: a poison queue inside, or added after,
//     the retry takes the first failure and the retry never runs). Its filter
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
//     number is the broker's delivery count. Outside the
//     breaker, so that waiting for the breaker is not mistaken for a failed
//     attempt, and a failure the breaker attributes to an outage does not use
//     up the message's attempts. Each attempt gets a fresh context (Watermill
//     issue #467: a timed-out context must not leak into the next attempt).
//  7. breaker: one sony/gobreaker breaker per handler. It opens when
//     breaker.consecutive_failures different messages failed their first
//     attempt with no attempt succeeding since (see Outages below). While it
//     is open the message waits and the handler is not called; since a
//     subscription delivers its next message only after the current one is
//     acked, the handler's intake pauses. After breaker.open_timeout, trial
//     attempts run, taken by messages that have not failed yet when any
//     wait. Inside the retry, so that it sees every attempt; outside the
//     inbox, so that a database outage opens it too.
//  8. attempt: bounds one attempt by handler_timeout, on a context a stop
//     does not cancel (context.WithoutCancel): an attempt that started
//     finishes and commits rather than being torn down halfway. The inner
//     part (stages 9 and 10 and the handler) runs in a goroutine of its own,
//     on a copy of the message and with state of its own. At
//     handler_timeout the stage stops waiting for it: the attempt is
//     abandoned and fails with a retryable error that says so, its
//     transaction (begun on the attempt's context) is rolled back and can
//     no longer commit, the worker is free for the next message, and the
//     goroutine, which shares nothing with the chain any more, is left to
//     finish (millrace_consumer_abandoned_attempts_total counts them,
//     millrace_consumer_abandoned_attempts_running those still running).
//     So a handler that ignores its context (a stuck driver call, a sleep)
//     holds neither a worker nor a stop past handler_timeout. An abandoned
//     attempt is a failed attempt of its message: it uses up one of
//     retry.max_attempts, its handler_timeout counts toward
//     retry.max_elapsed, and the message is poisoned when either runs out.
//  9. transaction: the inbox. One database transaction inserts
//     (consumer_group, event_id) into millrace_inbox first (ON CONFLICT DO
//     NOTHING; a concurrent duplicate waits on the row lock), applies the
//     ordering guard when on, runs the handler with the transaction in its
//     context, and commits; the router acks only after the commit. A
//     duplicate is acked without calling the handler; an error rolls back
//     the inbox row with everything else. With consumer.batch.max_messages
//     above 1 (group commit), messages in flight share one transaction, each
//     in a savepoint of its own that a failure or panic rolls back alone;
//     each is acked after the one COMMIT (see README.md). Chain.WrapBatch
//     takes a batch handler (BatchHandlerFunc) instead: each message's
//     savepoint holds its inbox insert and ordering guard, and the handler
//     runs once for the batch's new messages before the COMMIT.
//  10. Watermill's Recoverer again, around the handler: a panic in the
//     handler becomes a retryable error and the transaction rolls back.
//
// Do not add Watermill's Retry, PoisonQueue, CircuitBreaker or Timeout
// around the chain: it has its own, in the order above.
//
// # Outages and bad messages
//
// Only a message's first failed attempt counts toward opening the breaker:
// a message failing again, or hanging again at handler_timeout, tells
// nothing new about the dependency. So a few flaky or hung messages never
// open it while others succeed, and a dependency that fails every message
// opens it after consecutive_failures of them. A message that failed waits
// for its next attempt (in-process retry, open breaker) off its worker: the
// Dispatcher gives the worker to the next message meanwhile.
//
// A retryable failure counts against the message unless the breaker is open
// and the failures since the last success came from more than one message:
// then it is an outage, the message waits for the breaker and its attempts
// are not used up, however long the outage lasts. When one message alone
// keeps failing (every other message in flight succeeds, or it is the only
// one), it is a bad message: it is poisoned after retry.max_attempts even if
// its own failures opened the breaker, and the messages behind it flow again.
// With a single message in flight the two cannot be told apart that way; a
// handler with a dependency probe (Handler.Probe, a ProbeFunc) is told
// instead: after a retryable failure the breaker asks the probe, and a
// failing probe makes it an outage (not counted, the breaker held open until
// the probe passes), a passing one a failure of the message. See README.md.
//
// An attempt abandoned at handler_timeout is a failure for the breaker too
// (a dependency that hangs every call opens it, so it is tried once per
// open_timeout instead of by every worker; a few hung messages do not),
// but never an outage: it always
// uses up an attempt of its message, since each one may leave a goroutine
// behind and holding a message through an outage would add one at every
// trial.
//
// # Concurrency
//
// Chain.Subscriber returns a Dispatcher: it opens the handler's
// subscriptions, releases at most consumer.workers messages at a time to the
// router and, with consumer.ordered, one message per aggregate (or per
// Handler.OrderKey) at a time, in delivery order. A released message that
// waits after a failed attempt gives its worker back until its wait ends.
// README.md says what each broker allows.
//
// # Stopping
//
// When the Dispatcher stops, waits for a retry or the breaker end and the
// message is nacked. An attempt running goes on: when it commits the message
// is acked; when it fails, or is abandoned at handler_timeout, the message
// is nacked too, since a retryable failure seen while stopping is no verdict
// on the message. A stop never poisons.
// Every message in flight is thus settled within handler_timeout of the
// stop, and the Dispatcher's drain (handler_timeout + 5s) and the router's
// CloseTimeout (bus.Run: the longest handler_timeout + 10s) are real
// bounds. Abandoned goroutines still blocked then outlive the stop.
package middleware
