package middleware_test

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// The integration tests take the broker as a parameter: a kit is one
// broker's publisher and per-consumer-group subscribers. gochannel is
// Watermill's in-memory pub/sub; the others are millrace's own adapters on
// the servers internal/testing/brokertest points at (the local ones, or the URLs in
// the environment; Kafka is an in-process kfake cluster unless KAFKA_BROKERS
// names one). Every test gets its own topic, groups and streams/queues,
// removed when it ends.

func testLogger() watermill.LoggerAdapter {
	if os.Getenv("MILLRACE_TEST_LOG") != "" {
		return watermill.NewStdLogger(true, false)
	}
	return watermill.NopLogger{}
}

// kit is one broker as the tests use it.
type kit struct {
	name string
	pub  message.Publisher
	// source returns the consumer.Source of a consumer group, the stock
	// subscriber's (sourceFor gives bus.Run's).
	source func(group string) consumer.Source
	// provision makes topic and the groups' subscriptions exist before
	// anything is published, so that nothing published is dropped.
	provision func(t testing.TB, topic string, groups ...string)
	// broker is the adapter; nil for gochannel.
	broker adapters.Broker
}

// kitOptions tune a kit for one test.
type kitOptions struct {
	// ackWait is how long NATS waits for an ack before redelivering.
	// Defaults to 30s.
	ackWait time.Duration
	// maxAckPending bounds the messages a NATS consumer hands out unacked.
	// Defaults to 256.
	maxAckPending int
	// rebalanceTimeout is the Kafka group's rebalance timeout. Defaults to
	// 10s.
	rebalanceTimeout time.Duration
}

var kitNames = []string{"gochannel", bus.KindKafka, bus.KindNATS, bus.KindRabbitMQ}

// sourceFor is the Source bus.Run gives chain's handler in group: on a
// broker adapter the subscriber chosen by its settings
// (consumer.BrokerSource), on gochannel the only one.
func (k *kit) sourceFor(chain *middleware.Chain, group string) consumer.Source {
	if k.broker == nil {
		return k.source(group)
	}
	return consumer.BrokerSource(chain, k.broker, group)
}

func newKit(t testing.TB, name string, opts kitOptions) *kit {
	if name == "gochannel" {
		return gochannelKit(t)
	}
	return adapterKit(t, name, opts)
}

// gochannelKit is Watermill's in-memory pub/sub, persistent so that a
// subscription gets what was published before it. It has no consumer groups
// (every subscription gets every message) and delivers messages concurrently
// and unordered, several before the first is acked.
func gochannelKit(t testing.TB) *kit {
	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, testLogger())
	t.Cleanup(func() { gc.Close() })
	return &kit{
		name: "gochannel",
		pub:  gc,
		source: func(string) consumer.Source {
			return consumer.Source{NewSubscriber: func() (message.Subscriber, error) { return noClose{gc}, nil }}
		},
		provision: func(testing.TB, string, ...string) {},
	}
}

// noClose keeps the dispatcher from closing the shared GoChannel.
type noClose struct{ message.Subscriber }

func (noClose) Close() error { return nil }

// adapterKit is a millrace broker adapter, as bus.Run uses it.
func adapterKit(t testing.TB, kind string, opts kitOptions) *kit {
	var cfg bus.Config
	brokertest.Apply(t, kind, &cfg)
	cfg.Broker.NATS.Consumer.AckWait = cmp.Or(opts.ackWait, 30*time.Second)
	cfg.Broker.NATS.Consumer.MaxAckPending = cmp.Or(opts.maxAckPending, 256)
	cfg.Broker.NATS.Consumer.NakDelay = 100 * time.Millisecond
	cfg.Broker.RabbitMQ.Prefetch = 4
	// A consumer killed by a test leaves its Kafka group member behind until
	// its session times out; a rebalance waits for it at most this long.
	cfg.Broker.Kafka.SessionTimeout = 6 * time.Second
	cfg.Broker.Kafka.HeartbeatInterval = 2 * time.Second
	cfg.Broker.Kafka.RebalanceTimeout = cmp.Or(opts.rebalanceTimeout, 10*time.Second)
	broker, err := bus.OpenBroker(context.Background(), cfg, testLogger())
	require.NoError(t, err)
	t.Cleanup(func() { broker.Close() })
	return &kit{
		name:   kind,
		broker: broker,
		pub:    broker.Publisher(),
		source: func(group string) consumer.Source {
			return consumer.Source{
				Competing:      true,
				KeyPartitioned: kind == bus.KindKafka,
				NewSubscriber:  func() (message.Subscriber, error) { return broker.Subscriber(adapters.SubscriberSpec{Group: group}) },
			}
		},
		provision: func(t testing.TB, topic string, groups ...string) {
			require.NoError(t, broker.Provision(context.Background(), topic, groups...))
			brokertest.Cleanup(t, kind, topic, groups...)
		},
	}
}

// env is one test's database schema with millrace's tables and a business table.
type env struct {
	db     *sql.DB
	schema string
}

func newEnv(t testing.TB) *env {
	db := testdb.Open(t)
	schema := testdb.Schema(t, db)
	require.NoError(t, store.Migrate(context.Background(), db, store.Tables{Schema: schema, OutboxTopic: "millrace_outbox"}))
	_, err := db.Exec(`CREATE TABLE "` + schema + `".business (
		seq BIGSERIAL PRIMARY KEY,
		consumer_group TEXT NOT NULL,
		event_id TEXT NOT NULL,
		aggregate_id TEXT NOT NULL,
		version BIGINT NOT NULL
	)`)
	require.NoError(t, err)
	return &env{db: db, schema: schema}
}

func (e *env) table(name string) string { return `"` + e.schema + `".` + name }

// rows is the number of rows of table, or of its rows matching where (with
// args) when where is not empty.
func (e *env) rows(t testing.TB, table, where string, args ...any) int {
	t.Helper()
	query := `SELECT count(*) FROM ` + e.table(table)
	if where != "" {
		query += ` WHERE ` + where
	}
	return e.count(t, query, args...)
}

// newBilling is the ground of most tests: a schema of their own, a kit on
// broker, and a topic "orders" provisioned with the consumer group
// "billing".
func newBilling(t testing.TB, broker string, opts kitOptions) (e *env, k *kit, topic, group string) {
	t.Helper()
	e = newEnv(t)
	k = newKit(t, broker, opts)
	topic, group = uniqueName(t, "orders"), uniqueName(t, "billing")
	k.provision(t, topic, group)
	return e, k, topic, group
}

// write is a handler's business write: one row per processed event, no
// unique key, so a double effect shows as a second row.
func (e *env) write(ctx context.Context, group string, msg *message.Message) error {
	tx := middleware.Tx(ctx)
	if tx == nil {
		return fmt.Errorf("no transaction in the handler's context")
	}
	v, _ := strconv.ParseInt(msg.Metadata.Get(bus.AggregateVersionKey), 10, 64)
	_, err := tx.ExecContext(ctx, `INSERT INTO `+e.table("business")+` (consumer_group, event_id, aggregate_id, version) VALUES ($1, $2, $3, $4)`,
		group, msg.Metadata.Get(bus.EventIDKey), msg.Metadata.Get(bus.AggregateIDKey), v)
	return err
}

func (e *env) count(t testing.TB, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, e.db.QueryRow(query, args...).Scan(&n))
	return n
}

// event returns a message shaped like one millrace's relay delivers.
func event(id, aggregateID string, version int64, payload string) *message.Message {
	msg := message.NewMessage(id, []byte(payload))
	msg.Metadata.Set(bus.EventIDKey, id)
	msg.Metadata.Set(bus.EventTypeKey, "OrderPlaced")
	msg.Metadata.Set(bus.AggregateTypeKey, "order")
	msg.Metadata.Set(bus.AggregateIDKey, aggregateID)
	msg.Metadata.Set(bus.AggregateVersionKey, strconv.FormatInt(version, 10))
	msg.Metadata.Set(bus.SchemaVersionKey, "1")
	msg.Metadata.Set(bus.ContentTypeKey, "application/json")
	msg.Metadata.Set(bus.TraceparentKey, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	return msg
}

func publish(t testing.TB, pub message.Publisher, topic string, msgs ...*message.Message) {
	t.Helper()
	const chunk = 100
	for start := 0; start < len(msgs); start += chunk {
		batch := make([]*message.Message, 0, chunk)
		for _, m := range msgs[start:min(start+chunk, len(msgs))] {
			batch = append(batch, m.Copy())
		}
		require.NoError(t, pub.Publish(topic, batch...))
	}
}

// testConsumer is a running Watermill router with one chain per handler.
type testConsumer struct {
	stack  *middleware.Stack
	router *message.Router
	reg    *prometheus.Registry
	chains map[string]*middleware.Chain
}

type handlerSpec struct {
	name, topic, group string
	handle             func(msg *message.Message) error
	// batch, when set, is the handler instead of handle (Chain.WrapBatch).
	batch middleware.BatchHandlerFunc
	// outer wraps the chain (a test hook outside millrace's middleware).
	outer message.HandlerMiddleware
	// probe is the handler's dependency probe.
	probe middleware.ProbeFunc
}

func startConsumer(t testing.TB, k *kit, e *env, cfg middleware.Config, specs ...handlerSpec) *testConsumer {
	t.Helper()
	reg := prometheus.NewRegistry()
	stack, err := middleware.New(cfg, middleware.Deps{
		DB: e.db, Schema: e.schema, Registerer: reg, Logger: testLogger(), PoisonPublisher: k.pub,
	})
	require.NoError(t, err)
	require.NoError(t, stack.Check(context.Background()))
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, testLogger())
	require.NoError(t, err)
	c := &testConsumer{stack: stack, router: router, reg: reg, chains: map[string]*middleware.Chain{}}
	for _, s := range specs {
		chain, err := stack.Chain(middleware.Handler{Name: s.name, Topic: s.topic, ConsumerGroup: s.group, Probe: s.probe})
		require.NoError(t, err)
		c.chains[s.name] = chain
		handle := chain.Wrap
		if s.batch != nil {
			handle = func(message.NoPublishHandlerFunc) message.NoPublishHandlerFunc { return chain.WrapBatch(s.batch) }
		}
		h := router.AddConsumerHandler(s.name, s.topic, consumer.Subscriber(chain, k.source(s.group)), handle(s.handle))
		if s.outer != nil {
			h.AddMiddleware(s.outer)
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := router.Run(context.Background()); err != nil {
			t.Errorf("router: %v", err)
		}
	}()
	select {
	case <-router.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start")
	}
	var once sync.Once
	t.Cleanup(func() {
		once.Do(func() {
			_ = router.Close()
			<-done
		})
	})
	return c
}

// metric returns the value of the counter or gauge name with labels, 0 when absent.
func (c *testConsumer) metric(t testing.TB, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := c.reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if want, ok := labels[l.GetName()]; ok && want != l.GetValue() {
					continue metrics
				}
			}
			switch {
			case m.Counter != nil:
				return m.GetCounter().GetValue()
			case m.Gauge != nil:
				return m.GetGauge().GetValue()
			case m.Histogram != nil:
				return float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return 0
}

// messages is millrace_consumer_messages_total of handler and outcome.
func (c *testConsumer) messages(t testing.TB, handler, outcome string) float64 {
	return c.metric(t, middleware.MetricMessages, map[string]string{"handler": handler, "outcome": outcome})
}

func (c *testConsumer) close(t testing.TB) {
	t.Helper()
	require.NoError(t, c.router.Close())
}

// fastRetry is a retry ladder short enough for tests.
func fastRetry(cfg *middleware.Config, attempts int) {
	cfg.Retry = middleware.RetryConfig{
		MaxAttempts: attempts, InitialInterval: 20 * time.Millisecond, MaxInterval: 100 * time.Millisecond, MaxElapsed: time.Minute,
	}
}

func uniqueName(t testing.TB, suffix string) string {
	return testdb.UniqueName(t.Name() + "_" + suffix)
}
