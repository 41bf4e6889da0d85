// Package bus is millrace's public API: a service publishes integration events
// in the same database transaction as its business change, and millrace
// delivers them to the broker config.yaml names.
//
// # Configuration
//
// Config maps one to one onto config.yaml. LoadConfig reads the file, expands
// ${VAR} and ${VAR:-default}, applies the environment overrides (DATABASE_URL,
// MILLRACE_BROKER_KIND, KAFKA_BROKERS, AMQP_URL, NATS_URL), fills defaults and
// validates. A *ConfigError lists every problem at once, each naming its YAML
// path: `broker.kind: must be one of kafka, rabbitmq, nats; got "kafak"`.
// Unknown keys are errors.
//
// # Publishing
//
// Migrate creates the tables once (or run `millrace migrate`). Open returns a
// Bus; Publish writes events into the outbox table on the caller's *sql.Tx
// with the INSERT of watermill-sql's schema adapter (what Watermill's SQL
// publisher runs), each wrapped in Watermill's forwarder envelope:
//
//	tx, _ := db.BeginTx(ctx, nil)
//	tx.ExecContext(ctx, `INSERT INTO orders ...`)
//	b.Publish(ctx, tx, "orders.events", bus.Event{
//		Type: "OrderCreated", AggregateType: "order", AggregateID: id, Payload: body,
//	})
//	tx.Commit() // the order and its event become real together
//
// A rolled-back transaction leaves no event. Every event is checked before
// anything is written (required fields, codec, size limits, and what the
// configured broker would refuse or alter: BrokerConfig.Rules) and a
// refused call writes nothing. PublishInOwnTx is the explicit way to publish without
// a business transaction.
//
// # The event envelope
//
// Each event carries its id (UUIDv7 unless the caller sets one; equal to the
// Watermill message UUID and never changed by retries), type, aggregate type,
// id and version, schema version, occurred-at, correlation and causation ids,
// and the trace context and baggage of Publish's producer span (W3C
// traceparent, tracestate and baggage by default: the propagator is the one
// set globally, or WithPropagator's), as metadata under the exported *Key
// constants. The aggregate id is the partition and ordering key. The relay
// and the handler continue that trace, so one trace id covers them all.
//
// # Health, metrics and operations
//
// Liveness and Readiness say whether a running Bus is wedged and whether it
// can work now; HealthHandler serves them at /livez, /readyz and /healthz,
// as Run does beside /metrics on metrics.listen. Ops is the operations API
// (outbox status, the DLQ with failure groups, the relay quarantine, replay
// and purge with dry runs and selection tokens); package bus/console is
// the web console over it.
//
// # Compatibility with plain Watermill
//
// The outbox table is watermill-sql's default PostgreSQL layout,
// "watermill_<outbox.topic>". Rows written by Watermill's own
// forwarder.NewPublisher over an SQL publisher with ForwarderTopic set to
// outbox.topic are relayed like millrace's own, and EventFromMessage reads
// them.
//
// # Operations
//
// Ops (NewOps) is the operations API over an installation's tables, with
// no broker: outbox status, the dead-letter queue (the poison table) and
// the relay quarantine with list, show, replay and purge, and inbox
// pruning. The millrace command-line tool is flags and formatting over it.
package bus
