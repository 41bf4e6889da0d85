// Package nats connects millrace to NATS JetStream through watermill-nats
// (pkg/nats in JetStream mode) and nats.go.
//
// # Topology
//
// Each topic is a NATS subject with a stream of its own (file storage,
// limits retention, discard new, replicas, max age, duplicate window and max
// message size from broker.nats.stream). Each consumer group of a topic is a
// durable push consumer of that stream with a deliver group, explicit acks,
// and ack_wait, max_deliver and max_ack_pending from broker.nats.consumer.
// Stream and consumer names cannot contain '.', so they are the topic and
// group escaped one to one: see StreamName. Provision creates what is missing
// and reports what differs; publishing and subscribing provision on first use.
//
// # Publishing
//
// Every message carries Nats-Msg-Id = msg.UUID (the event id), so the
// stream's duplicate window stores an event the relay publishes twice only
// once. Publisher waits for each confirm; PublishBatch pipelines with
// JetStream's asynchronous publish on one connection, in slice order, with at
// most publish.max_pending unconfirmed, and reports each message's outcome.
//
// # Subscribing
//
// Subscriber(adapters.SubscriberSpec{Group: group}) is a watermill-nats
// subscriber with nats.ManualAck(), so nothing but msg.Ack acks a message
// (watermill-nats otherwise lets nats.go ack on its own ack timeout, on
// close and on an unmarshal error). A Nack comes back after
// consumer.nak_delay; an unacked message after consumer.ack_wait. It holds
// one message at a time per subscription.
//
// A spec with InFlight hands out up to InFlight messages of the group at
// once from one subscription and settles each on its own; with a
// RedeliveryWait too, a nack is delayed by RedeliveryWait(n) for the
// message's n-th delivery, n (JetStream's NumDelivered) recorded in
// spec.Deliveries: consumer chains hand it their retry ladder, so a failing
// message waits at the server, not in a worker. A RedeliveryWait without
// InFlight is the same with one message in flight.
//
// An Ordered spec is for ordered handlers: one process at a time consumes
// the group, holding a lease in the millrace_leases key-value bucket; on
// taking it, and after a missed delivery, it recreates the group's consumer
// from its ack floor, so what was not acked comes again in stream order
// before anything newer, and it hands out up to InFlight messages at once,
// one per aggregate.
//
// # Embedded server
//
// Package natsdev runs nats-server with JetStream inside the process, for
// tests and demos on a machine without a NATS server; importing it also lets
// broker.nats.embedded.enabled start one from config. This package does not
// link nats-server: a config asking for the embedded server in a program
// that does not import natsdev is an error naming
// broker.nats.embedded.enabled. embedded.sync chooses between fsync on every
// write and a flush interval.
//
// The README next to this file lists the settings, the traps handled and the
// ordering guarantees.
package nats
