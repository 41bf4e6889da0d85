package bus_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
	"github.com/millrace-io/millrace/adapters/nats"
	_ "github.com/millrace-io/millrace/adapters/nats/natsdev" // broker.nats.embedded
	"github.com/millrace-io/millrace/adapters/rabbit"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// hostileNames are refused as topics, consumer groups and handler names.
var hostileNames = map[string]string{
	"SQL injection":           `orders'; DROP TABLE canary; --`,
	"quoted identifier break": `orders"; DROP SCHEMA public CASCADE; --`,
	"NATS wildcard *":         "orders.*",
	"NATS wildcard >":         "orders.>",
	"bare >":                  ">",
	"RabbitMQ separator":      "orders:billing",
	"newline":                 "orders\nbilling",
	"NUL":                     "orders\x00",
	"space":                   "orders events",
	"Cyrillic look-alike":     "\u043erders", // о, not o
	"fullwidth look-alike":    "\uff4frders",
	"leading dot":             ".orders",
	"overly long":             strings.Repeat("o", 250),
	"empty":                   "",
}

// hostileIdentifiers are refused as database schemas and outbox topics.
var hostileIdentifiers = map[string]string{
	"SQL injection":           `public'; DROP TABLE canary; --`,
	"quoted identifier break": `public"; DROP TABLE canary; --`,
	"upper case":              "Public",
	"hyphen":                  "orders-v2",
	"leading digit":           "1orders",
	"newline":                 "public\nx",
	"Cyrillic look-alike":     "publi\u0441",
	"overly long":             strings.Repeat("p", 64),
	"empty":                   "",
}

const validTopic = "orders.events"

// clear says the error explains what a valid name is.
func requireClear(t *testing.T, err error, what string) {
	t.Helper()
	require.Error(t, err, what)
	require.Regexp(t, `must (not be empty|be at most|match)`, err.Error(), what)
}

// Every entry point that passes a name on to SQL or a broker refuses a
// hostile one with a clear error, before anything is written or created.
func TestHostileNamesAreRefusedEverywhere(t *testing.T) {
	t.Parallel()
	r := newHostileRig(t)
	t.Run("bus.Publish", r.busPublish)
	t.Run("bus.Handle", r.busHandle)
	t.Run("config", r.config)
	t.Run("store.Migrate", r.storeMigrate)
	t.Run("forwarder", r.forwarder)
	t.Run("middleware", r.middleware)
	for _, kind := range brokertest.Kinds {
		t.Run("adapter "+kind, func(t *testing.T) {
			t.Parallel()
			broker, nothingCreated := hostileBroker(t, kind)
			for label, name := range hostileNames {
				hostileBrokerCalls(t, broker, label, name)
			}
			nothingCreated(t)
		})
	}
}

// hostileRig is a migrated schema with a canary table, and a Bus on it.
type hostileRig struct {
	db  *sql.DB
	cfg bus.Config
	b   *bus.Bus
}

// newHostileRig migrates a schema and checks, at the end of the test,
// that nothing any hostile name did reached the database.
func newHostileRig(t *testing.T) *hostileRig {
	s := brokertest.NewService(t, bus.KindNATS)
	r := &hostileRig{db: s.DB, cfg: s.Config}
	_, err := r.db.Exec(`CREATE TABLE ` + r.qualified("canary") + ` (id int)`)
	require.NoError(t, err)
	tablesBefore := countTables(t, r.db, r.cfg.Database.Schema)
	t.Cleanup(func() {
		// Nothing any hostile name did reached the database.
		require.Equal(t, tablesBefore, countTables(t, r.db, r.cfg.Database.Schema))
		_, err := r.db.Exec(`SELECT FROM ` + r.qualified("canary"))
		require.NoError(t, err, "the canary table is still there")
	})
	r.b = s.Open(t)
	return r
}

// qualified is table in the test's schema.
func (r *hostileRig) qualified(table string) string {
	return `"` + r.cfg.Database.Schema + `".` + table
}

// busPublish: Publish refuses a hostile topic and writes nothing.
func (r *hostileRig) busPublish(t *testing.T) {
	ctx := context.Background()
	for label, name := range hostileNames {
		tx, err := r.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		err = r.b.Publish(ctx, tx, name, bus.Event{Type: "T", AggregateType: "a", AggregateID: "1", Payload: []byte(`{}`)})
		require.ErrorIs(t, err, bus.ErrInvalidTopic, label)
		requireClear(t, err, label)
		require.NoError(t, tx.Commit())
	}
	var rows int
	require.NoError(t, r.db.QueryRow(`SELECT count(*) FROM `+r.qualified("watermill_millrace_outbox")).Scan(&rows))
	require.Zero(t, rows, "no hostile topic reached the outbox")
}

// busHandle: Handle refuses a hostile topic, handler name or consumer group.
func (r *hostileRig) busHandle(t *testing.T) {
	ctx := context.Background()
	quiet := r.cfg
	quiet.Relay.Enabled = new(false)
	hb, err := bus.Open(ctx, quiet, r.db)
	require.NoError(t, err)
	defer hb.Close()
	noop := func(context.Context, bus.Event) error { return nil }
	for label, name := range hostileNames {
		err := hb.Handle(name, "handler", noop)
		require.ErrorContains(t, err, "topic: ", label)
		requireClear(t, err, label)
		err = hb.Handle(validTopic, name, noop)
		require.ErrorContains(t, err, "handler name: ", label)
		if name != "" { // an empty group means the handler's name
			err = hb.Handle(validTopic, "handler", noop, bus.WithConsumerGroup(name))
			require.ErrorContains(t, err, "consumer group: ", label)
			requireClear(t, err, label)
		}
	}
	require.ErrorContains(t, hb.Run(ctx), "no handler is registered", "no hostile handler was registered")
}

// config: the configuration names the field of a hostile name.
func (r *hostileRig) config(t *testing.T) {
	for label, name := range hostileIdentifiers {
		if name == "" {
			continue // empty means the default
		}
		c := r.cfg
		c.Database.Schema = name
		requireProblemAt(t, c, "database.schema", label)
		c = r.cfg
		c.Outbox.Topic = name
		requireProblemAt(t, c, "outbox.topic", label)
	}
	for _, name := range []string{"pg_temp", "pg_catalog", "pg_toast", "information_schema"} {
		c := r.cfg
		c.Database.Schema = name
		requireProblemAt(t, c, "database.schema", name+": a schema PostgreSQL reserves")
	}
	for label, name := range hostileNames {
		c := r.cfg
		c.Relay.ConsumerGroup = name
		if name == "" {
			continue // an empty consumer group means the default
		}
		requireProblemAt(t, c, "relay.consumer_group", label)
		c = r.cfg
		c.Consumer.Poison = middleware.PoisonConfig{Destination: middleware.PoisonToTopic, Topic: name}
		requireProblemAt(t, c, "consumer.poison.topic", label)
		c = r.cfg
		c.Consumer.Handlers = map[string]middleware.Config{name: {Workers: 1}}
		requireProblemAt(t, c, "consumer.handlers."+name, label)
	}
}

// storeMigrate: the store creates no schema for a hostile name.
func (r *hostileRig) storeMigrate(t *testing.T) {
	ctx := context.Background()
	for label, name := range hostileIdentifiers {
		err := store.Migrate(ctx, r.db, store.Tables{Schema: name, OutboxTopic: "millrace_outbox"})
		requireClear(t, err, label)
		err = store.Migrate(ctx, r.db, store.Tables{Schema: r.cfg.Database.Schema, OutboxTopic: name})
		requireClear(t, err, label)
		var schemas int
		require.NoError(t, r.db.QueryRow(`SELECT count(*) FROM pg_namespace WHERE nspname = $1`, name).Scan(&schemas))
		require.Zero(t, schemas, label)
	}
}

// forwarder: the relay and the operations client refuse hostile names.
func (r *hostileRig) forwarder(t *testing.T) {
	ctx := context.Background()
	broker, err := bus.OpenBroker(ctx, r.cfg, nil)
	require.NoError(t, err)
	defer broker.Close()
	for label, name := range hostileIdentifiers {
		_, err := forwarder.New(r.db, broker, forwarder.Outbox{Schema: name, Topic: "millrace_outbox"}, forwarder.Config{}, forwarder.Options{})
		requireClear(t, err, label)
		_, err = forwarder.New(r.db, broker, forwarder.Outbox{Schema: r.cfg.Database.Schema, Topic: name}, forwarder.Config{}, forwarder.Options{})
		requireClear(t, err, label)
		if name != "" {
			bad := r.cfg
			bad.Database.Schema = name
			_, err = ops.New(ctx, r.db, bad)
			requireClear(t, err, label)
		}
	}
	for label, name := range hostileNames {
		if name == "" {
			continue // the default group
		}
		_, err := forwarder.New(r.db, broker, forwarder.Outbox{Schema: r.cfg.Database.Schema, Topic: "millrace_outbox"},
			forwarder.Config{ConsumerGroup: name}, forwarder.Options{})
		requireClear(t, err, label)
		oc, err := ops.New(ctx, r.db, r.cfg)
		require.NoError(t, err)
		_, err = oc.OutboxStatus(ctx, name)
		requireClear(t, err, label)
	}
}

// middleware: the consumer chain refuses hostile names.
func (r *hostileRig) middleware(t *testing.T) {
	for label, name := range hostileIdentifiers {
		if name == "" {
			continue // the default schema
		}
		_, err := middleware.New(middleware.Config{}, middleware.Deps{DB: r.db, Schema: name})
		requireClear(t, err, label)
	}
	stack, err := middleware.New(middleware.Config{}, middleware.Deps{DB: r.db, Schema: r.cfg.Database.Schema})
	require.NoError(t, err)
	for label, name := range hostileNames {
		if name != "" {
			_, err = stack.Chain(middleware.Handler{Name: name, Topic: validTopic, ConsumerGroup: "g"})
			requireClear(t, err, label)
		}
		_, err = stack.Chain(middleware.Handler{Name: "h", Topic: name, ConsumerGroup: "g"})
		requireClear(t, err, label)
		_, err = stack.Chain(middleware.Handler{Name: "h", Topic: validTopic, ConsumerGroup: name})
		requireClear(t, err, label)
	}
}

func countTables(t *testing.T, db *sql.DB, schema string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_tables WHERE schemaname = $1`, schema).Scan(&n))
	return n
}

func requireProblemAt(t *testing.T, c bus.Config, path, label string) {
	t.Helper()
	err := c.WithDefaults().Validate()
	require.Error(t, err, "%s at %s", label, path)
	var found bool
	for _, p := range err.(*bus.ConfigError).Problems {
		if fe := p.(*confload.FieldError); fe.Path == path {
			found = true
		}
	}
	require.True(t, found, "%s: no problem at %s in %v", label, path, err)
}

// hostileBroker opens a broker of kind on a server this test can inspect
// completely, and returns a check that no topic, stream, exchange or queue
// was created on it.
func hostileBroker(t *testing.T, kind string) (adapters.Broker, func(*testing.T)) {
	t.Helper()
	ctx := context.Background()
	var cfg bus.Config
	cfg.Broker.Kind = kind
	var check func(*testing.T)
	switch kind {
	case bus.KindNATS:
		// A private server: its stream list is ours alone.
		cfg.Broker.NATS = nats.Config{URL: "nats://127.0.0.1:0", Embedded: nats.EmbeddedConfig{Enabled: true, StoreDir: t.TempDir()}}
	case bus.KindKafka:
		dev, err := kafkadev.Start(kafkadev.Options{Brokers: 1})
		require.NoError(t, err)
		t.Cleanup(dev.Close)
		// auto_provision off: Subscribe must check the topic itself.
		cfg.Broker.Kafka = kafka.Config{Brokers: dev.Addrs(), ReplicationFactor: 1, AutoProvision: new(false)}
		check = func(t *testing.T) {
			client, err := sarama.NewClient(dev.Addrs(), sarama.NewConfig())
			require.NoError(t, err)
			defer client.Close()
			topics, err := client.Topics()
			require.NoError(t, err)
			for _, topic := range topics {
				require.True(t, strings.HasPrefix(topic, "__"), "topic %q was created", topic)
			}
		}
	case bus.KindRabbitMQ:
		// The shared server: each name a hostile topic could have made is
		// looked up with a passive declaration, which fails when absent.
		brokertest.Apply(t, kind, &cfg)
		url := cfg.Broker.RabbitMQ.URL
		check = func(t *testing.T) {
			conn, err := amqp.Dial(url)
			require.NoError(t, err)
			defer conn.Close()
			for label, name := range hostileNames {
				if len(name) > 200 {
					continue // AMQP names are at most 255 bytes: these cannot exist
				}
				for _, q := range []string{rabbit.QueueName(name, "g"), rabbit.QueueName(validTopic, name), rabbit.UnroutedQueueName(name)} {
					ch, err := conn.Channel()
					require.NoError(t, err)
					_, err = ch.QueueDeclarePassive(q, true, false, false, false, nil)
					require.Error(t, err, "%s: queue %q exists", label, q)
				}
				ch, err := conn.Channel()
				require.NoError(t, err)
				require.Error(t, ch.ExchangeDeclarePassive(name, "fanout", true, false, false, false, nil), "%s: exchange exists", label)
			}
		}
	}
	b, err := bus.OpenBroker(ctx, cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	if kind == bus.KindNATS {
		url := b.(*nats.Broker).URL()
		check = func(t *testing.T) {
			nc, err := natsgo.Connect(url)
			require.NoError(t, err)
			defer nc.Close()
			js, err := jetstream.New(nc)
			require.NoError(t, err)
			names := js.StreamNames(ctx)
			var streams []string
			for n := range names.Name() {
				streams = append(streams, n)
			}
			require.NoError(t, names.Err())
			require.Empty(t, streams, "no stream was created")
		}
	}
	return b, check
}

// hostileBrokerCalls feeds name to every adapter entry point.
func hostileBrokerCalls(t *testing.T, b adapters.Broker, label, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	requireClear(t, b.Provision(ctx, name, "g"), label+": Provision topic")
	requireClear(t, b.Provision(ctx, validTopic, name), label+": Provision group")
	_, err := b.Subscriber(adapters.SubscriberSpec{Group: name})
	requireClear(t, err, label+": Subscriber group")
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: "g"})
	require.NoError(t, err)
	_, err = sub.Subscribe(ctx, name)
	requireClear(t, err, label+": Subscribe topic")
	require.NoError(t, sub.Close())
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	err = b.PublishBatch(ctx, []adapters.Outgoing{{Topic: name, Msg: msg}})
	requireClear(t, err, label+": PublishBatch")
	require.True(t, adapters.IsPermanent(err), "%s: a bad topic is permanent: %v", label, err)
	requireClear(t, b.Publisher().Publish(name, msg), label+": Publisher")
}
