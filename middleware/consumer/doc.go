// Package consumer is the runtime of millrace's consumer side: what feeds a
// handler's chain (package middleware) its messages. The Dispatcher
// subscribes to the broker, releases messages to Watermill's router with at
// most consumer.workers in flight and, when ordered, one per aggregate,
// lends each message its worker and delivery number (middleware.Lease,
// through Chain.Feed), and drains what is in flight when it stops.
// BrokerSource picks the subscriber a handler's settings call for on a
// broker, from the adapter contract: this package is the only part of the
// consumer side that knows package adapters, and the chain knows neither
// it nor the adapters.
//
// It is a public package beside the chain rather than an internal one
// because a service that builds its own Watermill router uses it: the
// chain's handler (chain.Wrap) goes with this package's Subscriber, as
// bus.Run does for every handler:
//
//	chain, err := stack.Chain(middleware.Handler{Name: "billing", Topic: "orders.events", ConsumerGroup: "billing"})
//	router.AddConsumerHandler("billing", "orders.events",
//		consumer.Subscriber(chain, consumer.BrokerSource(chain, broker, "billing")),
//		chain.Wrap(handle))
//
// # Concurrency
//
// Watermill's router starts a goroutine per message it receives, and its
// stock subscribers (amqp, nats, kafka) deliver the next message of a
// subscription only after the current one is acked. So concurrency comes
// from the number of subscriptions, and a second subscription of the same
// queue would receive the next event of an aggregate before the first is
// acked. Subscriber returns a Dispatcher that takes this into account:
//
//   - it opens consumer.workers subscriptions when Source.Competing and
//     unordered, one otherwise (Source.KeyPartitioned, i.e. Kafka, always
//     one);
//   - it releases at most consumer.workers messages at a time to the router
//     and, with consumer.ordered, one message per aggregate (or per
//     middleware.Handler.OrderKey: a saga's handlers are ordered by correlation id) at
//     a time, in delivery order; a message of a busy aggregate waits
//     without blocking other aggregates (at most prefetch held);
//   - a released message that waits after a failed attempt (the in-process
//     retry backoff, an open breaker) gives its worker back meanwhile and
//     takes one again, before any new message, when its wait ends: workers
//     bounds the attempts running at once, so one that keeps failing or
//     hanging does not hold the messages behind it back; an ordered one
//     still holds its aggregate;
//   - when a message of an aggregate is nacked, the ones queued behind it
//     are nacked too, so its redelivery comes before them.
//
// BrokerSource(chain, broker, group) is the Source bus.Run gives a
// handler: the subscriber its ordered and retry.mode settings call for on
// that broker. middleware/README.md says what each broker allows.
//
// # Stopping
//
// When the Dispatcher stops (the router's Close or the end of Subscribe's
// context), no new message is released and held ones are nacked; waits for
// a retry or the breaker end and the message is nacked. An attempt running
// goes on: when it commits the message is acked; when it fails, or is
// abandoned at handler_timeout, the message is nacked too, since a
// retryable failure seen while stopping is no verdict on the message. A
// stop never poisons. This happens while the subscriptions are still open;
// then they close. Every message in flight is thus settled within
// handler_timeout of the stop, and the Dispatcher's drain (handler_timeout
// + 5s) and the router's CloseTimeout (give it more than that; bus.Run: the
// longest handler_timeout + 10s) are real bounds, however the handlers
// block. Abandoned goroutines still blocked then outlive the stop; they
// commit nothing.
package consumer
