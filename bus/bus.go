package bus

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib" // also registers the "pgx" database/sql driver
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/forwarder/wal"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/wmslog"
)

// Bus is a service's handle on millrace: it writes events into the outbox in
// the caller's transaction. It is safe for concurrent use.
type Bus struct {
	cfg    Config
	db     *sql.DB
	ownsDB bool
	// pool is the pgxpool a Bus was opened on, if any: handlers' inbox
	// transactions are begun on it.
	pool   *pgxpool.Pool
	tables store.Tables
	// rules are what the configured broker carries unchanged.
	rules adapters.Rules
	// cePrefix is the CloudEvents header prefix, "" when they are off.
	cePrefix string
	logger   watermill.LoggerAdapter
	now      func() time.Time
	closed   atomic.Bool

	registerer prometheus.Registerer
	gatherer   prometheus.Gatherer
	// ownRegistry is true when the Bus made its registry (no WithRegistry).
	ownRegistry    bool
	tracer         trace.Tracer
	tracerProvider trace.TracerProvider          // nil: OpenTelemetry's global one
	propagator     propagation.TextMapPropagator // nil: forwarder.Propagator's default

	// run is what the health checks look at while Run runs; nil otherwise.
	run atomic.Pointer[runState]

	// routerMiddleware wraps every handler outside its chain.
	routerMiddleware []message.HandlerMiddleware

	mu       sync.Mutex
	handlers []handlerSpec
	running  bool
	// unknownTypes counts events typed handlers have no route for.
	unknownTypes *prometheus.CounterVec
	// sagas are the registered sagas, for the cleanup of completed ones.
	sagas []sagaRetention
	// sagaUnmatched counts saga events that found no running instance.
	sagaUnmatched *prometheus.CounterVec
}

// Option changes how Open builds a Bus.
type Option func(*Bus)

// WithRouterMiddleware adds Watermill handler middleware around every
// handler Run runs, outside millrace's chain: it sees a message before the
// inbox transaction begins, and after the chain returns (the transaction
// committed or rolled back) before the message is acked or nacked. Use it
// for instrumentation; retry, poison, breaker and timeout are already in the
// chain and must not be added again.
func WithRouterMiddleware(m ...message.HandlerMiddleware) Option {
	return func(b *Bus) { b.routerMiddleware = append(b.routerMiddleware, m...) }
}

// WithLogger sets the logger. Defaults to slog.Default(). A line's
// attributes come in the order of their keys. A failed attempt is one line
// at info, and a poisoned message one at warn, with its reason.
func WithLogger(l *slog.Logger) Option {
	return func(b *Bus) { b.logger = wmslog.New(l) }
}

// WithRegistry makes the Bus register its relay and consumer metrics on reg
// (and MetricsHandler serve reg). Defaults to a registry of the Bus's own,
// which also holds the Go runtime and process collectors.
func WithRegistry(reg *prometheus.Registry) Option {
	return func(b *Bus) { b.registerer, b.gatherer, b.ownRegistry = reg, reg, false }
}

// WithTracerProvider sets where the spans of Publish, the relay and the
// handlers go. Defaults to OpenTelemetry's global provider.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(b *Bus) { b.tracer, b.tracerProvider = tp.Tracer(tracerName), tp }
}

// WithPropagator sets how trace context and baggage travel in an event's
// metadata, from Publish through the relay to the handler. Defaults to the
// propagator set with otel.SetTextMapPropagator, or W3C trace context and
// baggage when none is set.
func WithPropagator(p propagation.TextMapPropagator) Option {
	return func(b *Bus) { b.propagator = p }
}

const tracerName = "github.com/millrace-io/millrace"

// DB is the database a Bus runs on, what Open and Migrate take: a
// database/sql pool opened with pgx/v5's stdlib driver, or a pgxpool.Pool.
type DB interface{ *sql.DB | *pgxpool.Pool }

// Open validates cfg (after WithDefaults), checks that the database answers
// and that the outbox table exists, and returns a Bus on db, the service's
// own pool:
//
//   - a *sql.DB opened with pgx/v5's stdlib driver (Open refuses another
//     driver, naming it): handlers' inbox transactions are *sql.Tx;
//   - a *pgxpool.Pool: handlers' inbox transactions are pgx.Tx, begun on
//     it. The relay, the poison table and the other statements millrace
//     runs on its own use a database/sql pool of their own, opened through
//     pgx's stdlib with the pool's connection config and closed by Close:
//     a connection released to a pgxpool keeps its session state, and the
//     relay's session lock and LISTEN must end with the connection that
//     holds them.
//
// Either way Publish and Schedule take the caller's transaction of either
// driver (a pgx.Tx through Pgx), and Tx gives a handler its own. When db
// is nil (bus.Open[*sql.DB](ctx, cfg, nil)), Open connects to database.url
// and Close closes that pool; Close never closes a db it was given.
func Open[D DB](ctx context.Context, cfg Config, db D, opts ...Option) (*Bus, error) {
	cfg, err := cfg.check()
	if err != nil {
		return nil, err
	}
	switch db := any(db).(type) {
	case *sql.DB:
		if db != nil {
			return open(ctx, cfg, db, nil, false, opts)
		}
	case *pgxpool.Pool:
		if db != nil {
			return open(ctx, cfg, stdlib.OpenDB(*db.Config().ConnConfig), db, true, opts)
		}
	}
	own, err := OpenDB(cfg.Database)
	if err != nil {
		return nil, err
	}
	return open(ctx, cfg, own, nil, true, opts)
}

// open is Open with cfg checked, on db, and with handlers' transactions
// begun on pool when it is not nil. Close closes db when ownsDB is set, and
// so does a failed open.
func open(ctx context.Context, cfg Config, db *sql.DB, pool *pgxpool.Pool, ownsDB bool, opts []Option) (*Bus, error) {
	b := &Bus{
		cfg:      cfg,
		db:       db,
		ownsDB:   ownsDB,
		pool:     pool,
		tables:   tablesOf(cfg),
		rules:    cfg.Broker.Rules(),
		cePrefix: cfg.cloudEventsPrefix(),
		logger:   wmslog.New(nil),
		now:      time.Now,
	}
	reg := prometheus.NewRegistry()
	b.registerer, b.gatherer, b.ownRegistry = reg, reg, true
	b.tracer = otel.GetTracerProvider().Tracer(tracerName)
	for _, o := range opts {
		o(b)
	}
	if b.ownRegistry {
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	if err := b.checkDatabase(ctx); err != nil {
		b.Close() //nolint:errcheck // reporting the first error
		return nil, err
	}
	if err := b.checkBroker(ctx); err != nil {
		b.Close() //nolint:errcheck // reporting the first error
		return nil, err
	}
	if err := b.ensureMessageSlot(ctx); err != nil {
		b.Close() //nolint:errcheck // reporting the first error
		return nil, err
	}
	return b, nil
}

// checkBroker refuses a config whose broker.kind is not the one the outbox
// is relayed to while events for that one are pending: its events would
// wait for a relay of its kind, and a relay of its kind would refuse to
// lead. With nothing pending the switch may go on: it warns.
func (b *Bus) checkBroker(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, b.cfg.Database.ConnectTimeout)
	defer cancel()
	recorded, err := b.tables.CheckBroker(ctx, b.db, b.cfg.Broker.Kind, store.RelayCursors(b.cfg.Relay.ConsumerGroup, b.cfg.Relay.OutboxShards()))
	if err != nil {
		return fmt.Errorf("millrace: broker.kind: %w; finish (or undo) the switch by the procedure in the README (Switching brokers)", err)
	}
	if recorded != "" && recorded != b.cfg.Broker.Kind {
		b.logger.Info("The outbox is relayed to another broker.kind, with nothing pending: a switch of brokers. "+
			"This service's events wait for a relay of its broker.kind", watermill.LogFields{"outbox_broker": recorded, "broker": b.cfg.Broker.Kind})
	}
	return nil
}

// ensureMessageSlot makes sure, with outbox.mode: wal_messages, that the
// WAL relay's slot exists before anything is published: PostgreSQL keeps
// a logical message for the slots that exist when it commits, and for
// none otherwise. It creates a missing slot (wal.CreateSlot: the role
// needs REPLICATION), or says how to.
func (b *Bus) ensureMessageSlot(ctx context.Context) error {
	if b.cfg.Outbox.Mode != OutboxModeWALMessages {
		return nil
	}
	slot := b.cfg.WALSlot()
	_, err := wal.Status(ctx, slot.URL, slot.Slot)
	if errors.Is(err, wal.ErrNoSlot) {
		_, err = wal.CreateSlot(ctx, slot)
		if errors.Is(err, wal.ErrSlotExists) { // a relay created it meanwhile
			err = nil
		}
	}
	if err != nil {
		return fmt.Errorf("millrace: outbox.mode: wal_messages needs the WAL relay's slot %q before the first Publish "+
			"(events written while it does not exist reach no relay); run `millrace wal create-slot`: %w", slot.Slot, err)
	}
	return nil
}

// WALSlot is the replication slot of the WAL relay (relay.source: wal) of
// c's outbox, as package wal configures it: relay.wal_slot or its
// default, on database.direct_url, else database.url (a pooler cannot
// carry replication). c must have its defaults applied.
func (c Config) WALSlot() wal.Config {
	schema, topic := c.Database.Schema, c.Outbox.Topic
	return wal.Config{URL: cmp.Or(c.Database.DirectURL, c.Database.URL), Schema: schema, OutboxTopic: topic,
		Slot: c.Relay.SlotName(schema, topic), MessagePrefix: tablesOf(c).MessagePrefix()}
}

func tablesOf(cfg Config) store.Tables {
	return store.Tables{Schema: cfg.Database.Schema, OutboxTopic: cfg.Outbox.Topic}
}

func (b *Bus) checkDatabase(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, b.cfg.Database.ConnectTimeout)
	defer cancel()
	if err := checkDriver(ctx, b.db); err != nil {
		return err
	}
	missing, err := store.Missing(ctx, b.db, b.tables.OutboxTable())
	if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) {
		// The server answered: a missing privilege, not a network problem.
		return fmt.Errorf("millrace: look up outbox table %s: %w", b.tables.OutboxTable(), err)
	}
	if err != nil {
		return fmt.Errorf("millrace: database %s not reachable within database.connect_timeout (%s): %w",
			redactURL(b.cfg.Database.URL), b.cfg.Database.ConnectTimeout, err)
	}
	if missing != "" {
		return fmt.Errorf("millrace: outbox table %s does not exist: run `millrace migrate` or bus.Migrate first", missing)
	}
	return nil
}

// OpenDB opens a database/sql pool on cfg.URL through pgx/v5's stdlib driver.
func OpenDB(cfg DatabaseConfig) (*sql.DB, error) {
	db, err := sql.Open("pgx", cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("millrace: open database %s: %w", redactURL(cfg.URL), err)
	}
	return db, nil
}

// openDirect opens a pool on database.direct_url for the relay's LISTEN,
// or returns nil when none is set.
func (b *Bus) openDirect() (*sql.DB, error) {
	if b.cfg.Database.DirectURL == "" {
		return nil, nil
	}
	db, err := sql.Open("pgx", b.cfg.Database.DirectURL)
	if err != nil {
		return nil, fmt.Errorf("millrace: open database.direct_url %s: %w", redactURL(b.cfg.Database.DirectURL), err)
	}
	return db, nil
}

// Migrate creates the outbox, offsets, inbox, poison and aggregate-versions
// tables and the outbox NOTIFY trigger in cfg's schema, in one transaction
// on db (a *sql.DB, or a *pgxpool.Pool). It is idempotent and safe to run
// from several instances at once. It needs no broker: cfg's broker section
// is not checked.
func Migrate[D DB](ctx context.Context, db D, cfg Config) error {
	cfg, err := cfg.checkFor(false)
	if err != nil {
		return err
	}
	var sqlDB *sql.DB
	switch db := any(db).(type) {
	case *sql.DB:
		sqlDB = db
	case *pgxpool.Pool:
		if db != nil {
			sqlDB = stdlib.OpenDBFromPool(db)
			defer sqlDB.Close()
		}
	}
	if sqlDB == nil {
		return errors.New("millrace: Migrate needs a database; it is nil")
	}
	return store.Migrate(ctx, sqlDB, tablesOf(cfg))
}

// GrantSQL returns the GRANT statements that give role exactly the
// privileges a service needs at run time on cfg's tables (publish, relay,
// consumers), one per object with a comment saying what needs it. Run them
// as the tables' owner, the role that ran Migrate. role must be a lowercase
// identifier. With relay.source: wal it ends with the ALTER ROLE ...
// REPLICATION the WAL relay needs and the creation of the publication its
// slot streams, which the service role cannot create (both run by a
// superuser; see wal.PublicationSQL).
func GrantSQL(cfg Config, role string) (string, error) {
	cfg = cfg.WithDefaults()
	tables := tablesOf(cfg)
	sql, err := store.GrantSQL(tables, role)
	if err == nil && cfg.Relay.Source == forwarder.SourceWAL {
		sql += store.ReplicationSQL(role) + wal.PublicationSQL(tables.Schema, tables.OutboxTopic)
	}
	return sql, err
}

// Config returns the configuration the Bus runs with, defaults applied.
func (b *Bus) Config() Config { return b.cfg }

// DB returns the database pool the Bus uses.
func (b *Bus) DB() *sql.DB { return b.db }

// Execer runs a statement in the caller's transaction: what Publish,
// Schedule and CancelScheduled write in. A *sql.Tx is one, and so is what
// the ORMs on database/sql hand out for theirs (sqlx's *sqlx.Tx, bun's
// bun.Tx, GORM's tx.Statement.ConnPool inside db.Transaction); a pgx.Tx
// is one through Pgx; a handler's own is Tx[Execer](ctx), whatever the
// driver. Pass a transaction, not a pool: a pool's statement commits on
// its own, outside the business change.
type Execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// Publish writes events for topic into the outbox within tx, the caller's
// business transaction (a *sql.Tx, bus.Pgx(tx) for a pgx.Tx, bus.Tx[bus.Execer](ctx)
// in a handler): they are relayed to the broker only if tx commits, and
// never if it rolls back. Every event is checked before anything is
// written; on any error nothing is written. Publishing no events is a
// no-op. The events go in one INSERT (per 1000 events), the same bytes in
// every pgx query exec mode; with outbox.mode: wal_messages, in one
// statement of logical messages instead (see docs/WAL.md). A transaction already committed or rolled
// back yields an error wrapping sql.ErrTxDone (pgx.ErrTxClosed for pgx).
//
// Publish runs in a producer span ("<topic> publish") whose trace context,
// with the context's baggage, goes into each event's metadata: the relay's
// and the handler's spans continue that trace.
func (b *Bus) Publish(ctx context.Context, tx Execer, topic string, events ...Event) (err error) {
	if isNil(tx) {
		return ErrNilTx
	}
	if len(events) == 0 {
		_, _, err := b.outboxRows(ctx, topic, nil) // checks the topic; writes nothing
		return err
	}
	ctx, span := b.tracer.Start(ctx, topic+" publish", trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(
			attribute.String("messaging.operation.type", "create"),
			attribute.String("messaging.destination.name", topic),
			attribute.Int("messaging.batch.message_count", len(events)),
		))
	defer func() {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()
	rows, _, err := b.outboxRows(ctx, topic, events)
	if err != nil {
		return err
	}
	write := b.tables.WriteOutbox
	if b.cfg.Outbox.Mode == OutboxModeWALMessages {
		write = b.tables.EmitOutbox
	}
	if err := write(ctx, tx, rows); err != nil {
		return fmt.Errorf("millrace: %w", err)
	}
	return nil
}

// checkOpen returns an error matching ErrClosed once the Bus is closed.
func (b *Bus) checkOpen() error {
	if b.closed.Load() {
		return errBusClosed
	}
	return nil
}

// PublishInOwnTx writes events into the outbox in a transaction of their own,
// for code that has no business transaction. They still go through the outbox
// and the relay; only the atomicity with a business change is missing.
func (b *Bus) PublishInOwnTx(ctx context.Context, topic string, events ...Event) error {
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("millrace: begin transaction: %w", err)
	}
	if err := b.Publish(ctx, tx, topic, events...); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("millrace: commit outbox transaction: %w", err)
	}
	return nil
}

// outboxRows checks every event and wraps each in a forwarder envelope; ids
// are the events' ids, generated where an event has none.
func (b *Bus) outboxRows(ctx context.Context, topic string, events []Event) (rows []*message.Message, ids []string, err error) {
	if err := b.checkOpen(); err != nil {
		return nil, nil, err
	}
	if err := names.Topic(topic); err != nil {
		return nil, nil, fmt.Errorf("%w %q: %v", ErrInvalidTopic, topic, err)
	}
	if err := b.rules.CheckTopic(topic); err != nil {
		return nil, nil, fmt.Errorf("%w %q on broker.kind %s: %w", ErrInvalidTopic, topic, b.cfg.Broker.Kind, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	now := b.now()
	prop := forwarder.Propagator(b.propagator)
	rows = make([]*message.Message, len(events))
	ids = make([]string, len(events))
	for i, e := range events {
		msg, err := e.toMessage(ctx, b.cfg.Outbox, now, prop, b.cePrefix)
		if err == nil {
			err = refusedByBroker(b.rules.CheckMessage(topic, msg))
		}
		if err != nil {
			var ee *EventError
			if errors.As(err, &ee) {
				ee.Index, ee.Type = i, e.Type
			}
			return nil, nil, err
		}
		payload, err := envelope.Wrap(topic, msg)
		if err != nil {
			return nil, nil, fmt.Errorf("millrace: wrap event %d: %w", i, err)
		}
		rowID := msg.UUID
		if len(rowID) > 36 { // the outbox uuid column is VARCHAR(36)
			rowID = watermill.NewUUID()
		}
		rows[i] = message.NewMessage(rowID, payload)
		rows[i].Metadata.Set(store.BrokerKindKey, b.cfg.Broker.Kind) // the relay forwards it to this kind only
		ids[i] = msg.UUID
	}
	return rows, ids, nil
}

// Close releases what the Bus owns. It is idempotent.
func (b *Bus) Close() error {
	if b.closed.Swap(true) {
		return nil
	}
	if b.ownsDB {
		return b.db.Close()
	}
	return nil
}

// redactURL is raw without its password (in the user info or the query).
func redactURL(raw string) string { return confload.RedactURL(raw) }

// refusedByBroker turns the broker's *adapters.RefusedError into an
// *EventError naming the Event field behind the refused part.
func refusedByBroker(err error) error {
	if err == nil {
		return nil
	}
	var re *adapters.RefusedError
	if !errors.As(err, &re) {
		return &EventError{Field: "Metadata", Kind: ErrRefusedByBroker, Detail: err.Error(), Err: err}
	}
	ee := &EventError{Field: "Metadata", Key: re.Key, Kind: ErrRefusedByBroker, Detail: re.Error(), Err: re}
	switch re.Part {
	case adapters.PartID:
		ee.Field, ee.Key = "ID", ""
	case adapters.PartSize:
		ee.Field = "Payload"
	case adapters.PartTopic:
		return fmt.Errorf("%w: %w", ErrInvalidTopic, re)
	default:
		if field, ok := envelopeFields[re.Key]; ok {
			ee.Field, ee.Key = field, ""
		}
	}
	return ee
}

// envelopeFields maps the envelope's metadata keys to the Event fields
// they come from.
var envelopeFields = map[string]string{
	EventIDKey: "ID", EventTypeKey: "Type", AggregateTypeKey: "AggregateType", AggregateIDKey: "AggregateID",
	AggregateVersionKey: "AggregateVersion", SchemaVersionKey: "SchemaVersion", OccurredAtKey: "OccurredAt",
	CorrelationIDKey: "CorrelationID", CausationIDKey: "CausationID", ContentTypeKey: "ContentType",
}
