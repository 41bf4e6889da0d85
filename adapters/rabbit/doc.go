// Package rabbit connects millrace to RabbitMQ quorum queues: the
// broker.rabbitmq section of config.yaml turns into a *Broker (Open) that
// implements adapters.Broker.
//
// # Topology
//
// A topic is a durable fanout exchange; each consumer group has its own
// durable quorum queue bound to it, so every group gets every message and the
// subscribers of one group compete for it. Names (topics and groups never
// contain ':'):
//
//	exchange <topic>              fanout, alternate-exchange <topic>:unrouted
//	exchange <topic>:unrouted     fanout, internal
//	queue    <topic>::unrouted    quorum: messages that reached <topic> while no group queue was bound
//	exchange <topic>:dlx          direct: the topic's dead letters
//	queue    <topic>:<group>      quorum, x-delivery-limit, dead letters to <topic>:dlx
//	queue    <topic>:<group>:dlq  quorum: the group's dead letters
//	queue    <topic>:<group>:retry  quorum: messages waiting for their next delivery
//
// Provision declares all of it, idempotently; Subscribe does it for its
// group, and PublishBatch for a topic on first use. An existing object with
// other settings (a classic queue where a quorum queue belongs, another
// delivery limit) is a permanent error wrapping adapters.ErrTopologyConflict that
// names the object and quotes the broker's description of the difference.
// Topology changes of existing queues need a new queue or a policy.
//
// # Publishing
//
// PublishBatch is the relay's path: messages are persistent and mandatory,
// pipelined on one confirm-mode channel in slice order (up to 1024
// unconfirmed at a time, amqp091 deferred confirms), and the call returns
// once every one is confirmed, or a *adapters.BatchError with one error per
// message. A message published while no consumer group's queue exists is
// parked in UnroutedQueueName(topic) through the alternate exchange: it is
// confirmed, nothing is lost, and the relay moves on. Only if even the
// parking queue is gone does the broker return the message (basic.return);
// that is a retryable ErrUnroutable and the topology is declared again on
// the next call. Bodies over Config.MaxMessageBytes (or the server's
// max_message_size, once the server refused one) and metadata that does not
// fit one AMQP frame are refused before sending with a permanent error
// wrapping adapters.ErrMessageTooLarge; the rest of the batch still goes.
// A lost connection fails what was in flight with retryable errors and the
// next call reconnects. If ctx ends while the broker does not answer (a
// memory or disk alarm blocks publishers), the publishing connection is
// dropped so the call returns; while the broker reports the connection
// blocked, calls fail at once with ErrBlocked.
//
// # Consuming
//
// Each Subscriber has its own connection. A subscription consumes its
// group's queue with Config.Prefetch, hands out one message at a time and
// waits for its Ack (basic.ack) or Nack (basic.nack, requeue). Closing the
// subscriber, cancelling its context before a message is handed out, or a
// lost connection returns unacked messages to the queue; nothing is ever
// acked but by msg.Ack(). After a connection loss the subscription
// reconnects by itself with backoff.
//
// Order: a queue with one subscription delivers in publish order. With
// Prefetch 1 (the default) a nacked message is redelivered before any later
// one, so order holds across redeliveries too; with a larger prefetch the
// messages already prefetched overtake a nacked one. Competing subscribers
// of one group share the queue and give no order between them.
//
// An Ordered adapters.SubscriberSpec (adapters.Capabilities.OrderedFlight;
// bus.Run asks for it for handlers with consumer.ordered) is for many messages in flight without that price:
// its subscription consumes with a prefetch of consumer.prefetch and hands
// deliveries out without waiting for acks, one per aggregate (aggregate-id)
// at a time, holding the later ones of a busy aggregate itself, so that none
// is handed out after its predecessor's Nack; each Ack acks its own delivery
// tag, out of order, never `multiple`. A Nack is never a basic.nack (which lets later
// messages pass): the subscription stops handing out, waits until what it
// handed out is settled, and closes its channel; the quorum queue then puts
// the unacked messages back at its head in their delivery order, and the
// subscription consumes again. Closing it, a crash or a lost connection
// return them the same way. With the consumer Dispatcher holding the
// messages of busy aggregates, an ordered handler runs consumer.workers
// aggregates at once from its one queue, in order across nacks and
// restarts. Each such return counts as a delivery of every message
// returned (Config.DeliveryLimit).
//
// Quorum queues count redeliveries: the handler sees DeliveryCountKey
// ("x-delivery-count") from the second delivery on, and past
// Config.DeliveryLimit RabbitMQ moves the message to the group's dead-letter
// queue with its x-death history (DeathKey). Dead-lettering is
// at-least-once (x-dead-letter-strategy at-least-once, which RabbitMQ honours
// only with x-overflow reject-publish): a dead letter stays in the source
// queue until the dead-letter queue has it.
//
// A spec with InFlight (adapters.Capabilities.ConcurrentFlight) consumes
// with a prefetch of its own and hands out that many deliveries at once,
// each settled on its own. One with a RedeliveryWait
// (adapters.Capabilities.ScheduledRedelivery, for unordered groups) parks
// a nacked message in the group's retry queue with an expiration of
// the wait before its next delivery and the delivery header
// DeliveryNumberKey, acks it once the broker confirmed the copy, and
// RabbitMQ dead-letters it back to the group's queue when it expires; each
// delivery's number (recorded in the spec's adapters.Deliveries) counts the parkings and the
// quorum queue's redeliveries, across consumer restarts.
//
// Marshaler turns every AMQP header into string metadata, so those
// non-string headers never make a delivery fail to unmarshal; it also works
// with watermill-amqp's own publisher and subscriber.
package rabbit
