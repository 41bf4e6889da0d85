// Package bus is millrace's public API: a service publishes integration events
// in the same database transaction as its business change, and millrace
// delivers them to the broker config.yaml names.
//
// # Configuration
//
// Config maps one to one onto config.yaml. LoadConfig reads the file, expands
// ${VAR} and ${VAR:-default}, applies the environment overrides (DATABASE_URL,
// MILLRACE_BROKER_KIND, KAFKA_BROKERS, AMQP_URL, NATS_URL), fills defaults and
// validates. A *ConfigError lists every problem at once, type errors
// included, each naming its YAML path: `broker.kind: must be one of kafka,
// rabbitmq, nats; got "kafak"`. Unknown keys are errors, and booleans are
// YAML 1.2's: true and false, unquoted (yes, on and "true" are refused).
// Overrides under consumer.handlers.<name> are checked against the
// registered handlers when Run starts: a name that none has is a
// *ConfigError listing them (Saga.Handlers gives a saga's names).
//
// # Publishing
//
// Migrate creates the tables once (or run `millrace migrate`). Open returns a
// Bus; Publish writes events into the outbox table in the caller's
// transaction (an Execer: a *sql.Tx, or bus.Pgx(tx) for a pgx.Tx) with the INSERT of watermill-sql's schema adapter (what Watermill's SQL
// publisher runs), each wrapped in Watermill's forwarder envelope (typed
// topics, below, build these events from Go values):
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
// # Scheduled events
//
// Schedule writes events in the caller's transaction to be published at a
// due time (DueAt) or after a delay (DueIn); CancelScheduled deletes one
// before it is due, in the caller's transaction too. They wait in a table of
// their own; the relay moves each into the outbox when it is due, in one
// transaction, and from then on it is ordered like an event published at
// that moment. A bad due time is a *ScheduleError naming the field.
//
// # Sagas
//
// A Saga[S] (NewSaga) is an orchestration: its state S lives in a table of
// its own, one row per instance; StartWith and Then add the typed events
// that start an instance or move one on, with the correlation that finds
// it; Handle registers it. A step runs in its handler's inbox transaction
// and the state is saved with a version check, so the state change, the
// commands the step publishes and the inbox mark commit together; a
// version conflict reruns the step on the newer state. Timeouts are
// scheduled events to the saga (SagaContext.ScheduleTimeout,
// CancelTimeout); Complete ends an instance, deleted after its retention.
// A saga's handlers are ordered by its correlation id: two events of one
// instance on one topic are handled one after the other, in delivery
// order, so a cancellation never overtakes the event that started the
// instance (consumer.handlers.<handler>.ordered: false turns it off).
// Choreography needs nothing of this: handlers that publish in their
// inbox transaction are atomic already.
//
// # Typed events
//
// A Topic[T] declares a topic with the Go type of its events once, with its
// wire name (T's EventType method, or TypeName), schema version (Version),
// codec (WithCodec: CodecJSON, CodecProtobuf, or one of RegisterCodec's)
// and upcasters from older versions (Upcast). NewTopic checks all of it:
//
//	var OrderPlaced = bus.Must(bus.NewTopic[orders.Placed]("orders.events",
//		bus.Version(2), bus.Upcast(1, orders.PlacedFromV1)))
//
//	err := OrderPlaced.Publish(ctx, b, tx, orders.Placed{ID: id, TotalCents: 4200})
//	err = OrderPlaced.Handle(b, "billing", func(ctx context.Context, m bus.Message[orders.Placed]) error {
//		_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO invoices ...`, m.Value.ID, m.ID)
//		return err
//	})
//
// NewTopic checks the name against the rules of every broker kind, not
// only the configured one: "shop.orders." works on Kafka and is no NATS
// subject, so it is refused everywhere.
// Publish accepts only T; the aggregate comes from T's Aggregate method.
// A handler gets the value at its Topic's version, with the attempt's
// number (Message.Attempt, 1 at the first delivery): older events arrive
// upcast, newer ones, payloads that do not decode and content types of
// another codec are poisoned at once with a reason naming the versions or
// the field. Several types on one topic are several Topics of one name, and
// HandleTypes routes them by event-type within one handler and consumer
// group. An event of a type no route names (another handler's, on a shared
// topic) is acked without an attempt, as a saga does, and counted
// (millrace_consumer_messages_total{outcome="other_type"}, and by type in
// millrace_consumer_unknown_types_total); WithUnknownTypes(PoisonUnknown)
// poisons it instead, for a handler that owns its topic.
//
// # Where a new consumer group starts
//
// consumer.start says where a handler's consumer group starts reading its
// topic when the group does not exist yet: "new" (the default), the events
// published from the moment Run first provisions the group, or "all", every
// event the topic still holds (NATS, Kafka; RabbitMQ queues keep no history,
// and the config refuses it there). A group that exists keeps its position.
//
// # Batch handlers
//
// HandleBatch and Topic.HandleBatch register a handler that gets the
// events of a batch (consumer.batch.max_messages, max_wait) at once, in one
// inbox transaction, for a bulk insert or one call per batch: duplicates
// never reach it, BatchFailures fails single events (retried or poisoned
// alone, the others committed), any other error the whole batch, and a
// panic splits the batch so that the event causing it is found alone.
//
// outbox.codec checks and labels only events without a ContentType; a
// typed topic sets ContentType from its codec, so protobuf topics publish
// under outbox.codec "json" too (a JSON content type is always checked to
// be JSON).
//
// # Running
//
// Run connects to the broker and runs the relay and the registered
// handlers until its ctx ends, cancelled or at its deadline: either is a
// graceful stop, and Run returns nil. Register handlers before Run; after
// Close, every registration (Handle, the typed ones, Saga.Handle) and Run
// return ErrClosed. In the log (WithLogger) a failed attempt is one line
// at info and a poisoned message one at warn with its reason, each line's
// attributes in the order of their keys.
//
// # pgx
//
// database/sql and pgx are served by the same calls. Open and Migrate take
// a *sql.DB (opened with pgx/v5's stdlib driver: Open refuses another) or a
// *pgxpool.Pool. Publish, Schedule and CancelScheduled take an Execer: a
// *sql.Tx (or an ORM's transaction on database/sql), or a pgx.Tx (from a
// pgxpool.Pool or a pgx.Conn) through Pgx, and write the same rows either
// way. A handler's inbox transaction is Tx[T](ctx): a *sql.Tx on a Bus
// opened on a *sql.DB, a pgx.Tx on one opened on a *pgxpool.Pool, an
// Execer on either. Tx panics, naming the cause, where ctx holds no inbox
// transaction of that type; a handler that does so is poisoned at once
// with that reason.
//
// Every statement millrace runs works in each of pgx's query exec modes
// (default_query_exec_mode in database.url, or the DefaultQueryExecMode of
// the pool's pgx.ConnConfig for a *pgxpool.Pool), and writes what
// Publish accepts byte for byte in each: a service behind a pooler in
// transaction mode that keeps no prepared statements (PgBouncer before
// 1.21) uses exec or simple_protocol. No part of millrace keeps state in a
// session: the relay's leadership is a lease row with a fencing token, and
// it LISTENs on database.direct_url when one is set (else it polls; see
// the forwarder package).
//
// # CloudEvents
//
// With outbox.cloudevents.enabled, every event also carries the
// CloudEvents binary-mode attributes (id, type, source, specversion, time)
// as headers under the prefix of the broker's CloudEvents binding.
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
// as Run does beside /metrics on metrics.listen. Package ops is the
// operations API (outbox status, the DLQ with failure groups, the relay
// quarantine, replay and purge with dry runs and selection tokens);
// package ops/console is the web console over it.
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
// Package ops (ops.New, ops.Open) is the operations API over an
// installation's tables, with no broker: outbox status, the dead-letter
// queue (the poison table) and the relay quarantine with list, show, replay
// and purge, and inbox pruning. The millrace command-line tool is flags and
// formatting over it. A replay from the poison table carries the event's
// own metadata (EventMetadata: what Publish accepted, none of the broker's
// delivery headers) and reaches only
// the consumer groups the event was poisoned in: the chain of every other
// group acks it unprocessed (middleware.ReplayGroupsKey).
package bus
