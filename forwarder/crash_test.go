package forwarder_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testkit/child"
)

// Environment of a relay child process.
const (
	relayRole      = "relay"
	childKindEnv   = "MILLRACE_RELAY_KIND"
	childSchemaEnv = "MILLRACE_RELAY_SCHEMA"
	childKillEnv   = "MILLRACE_RELAY_KILL" // before-publish:N, after-publish:N or after-move:N
	childAppEnv    = "MILLRACE_RELAY_APP"  // application_name of its sessions
	childShardsEnv = "MILLRACE_RELAY_SHARDS"
	childMetrics   = "MILLRACE_RELAY_METRICS" // address to serve /metrics on
)

func TestMain(m *testing.M) {
	// The crash tests re-execute this test binary as a relay process.
	if child.Role() == relayRole {
		os.Exit(runRelayChild())
	}
	os.Exit(m.Run())
}

// runRelayChild runs a relay until SIGTERM, or kills itself with SIGKILL at
// the point MILLRACE_RELAY_KILL names.
func runRelayChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	var cfg bus.Config
	cfg.Database.URL = testdb.URL()
	if app := os.Getenv(childAppEnv); app != "" {
		sep := "?"
		if strings.Contains(cfg.Database.URL, "?") {
			sep = "&"
		}
		cfg.Database.URL += sep + "application_name=" + app
	}
	cfg.Database.Schema = os.Getenv(childSchemaEnv)
	cfg.Broker.Kind = os.Getenv(childKindEnv)
	cfg.Broker.NATS.URL = os.Getenv("NATS_URL")
	cfg.Broker.RabbitMQ.URL = os.Getenv("AMQP_URL")
	cfg.Broker.Kafka.Brokers = strings.Split(os.Getenv("KAFKA_BROKERS"), ",")
	cfg = cfg.WithDefaults()
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	broker, err := bus.OpenBroker(ctx, cfg, watermill.NopLogger{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay child:", err)
		return 1
	}
	defer broker.Close()
	relayCfg := crashConfig()
	if n, err := strconv.Atoi(os.Getenv(childShardsEnv)); err == nil {
		relayCfg = shardCrashConfig(n)
	}
	var opts forwarder.Options
	if addr := os.Getenv(childMetrics); addr != "" {
		reg := prometheus.NewRegistry()
		opts.Registerer = reg
		l, err := net.Listen("tcp", addr)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		go func() { _ = http.Serve(l, promhttp.HandlerFor(reg, promhttp.HandlerOpts{})) }()
	}
	f, err := forwarder.New(db, broker, forwarder.Outbox{Schema: cfg.Database.Schema, Topic: cfg.Outbox.Topic}, relayCfg, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if point, n, ok := strings.Cut(os.Getenv(childKillEnv), ":"); ok {
		calls, _ := strconv.Atoi(n)
		hook := func(int) {
			if calls--; calls <= 0 {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {}
			}
		}
		switch point {
		case "before-publish":
			forwarder.SetBeforePublish(f, hook)
		case "after-publish":
			forwarder.SetAfterPublish(f, hook) // confirmed by the broker, not yet acked
		case "after-move":
			forwarder.SetAfterScheduledMove(f, hook) // due scheduled rows committed into the outbox
		}
	}
	if err := f.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// endToEnd is a test's own schema with a Bus, a broker of kind, a topic and
// a collector of everything that reaches the topic.
type endToEnd struct {
	db     *sql.DB
	bus    *bus.Bus
	cfg    bus.Config
	broker adapters.Broker
	topic  string
	got    *collector
}

func newEndToEnd(t *testing.T, kind, prefix string) endToEnd {
	ctx := context.Background()
	svc := brokertest.NewService(t, kind)
	db := svc.DB
	b := svc.Open(t)
	topic := prefix + "-" + testdb.UniqueName("")[3:]
	group := topic + "-check"
	brokertest.Cleanup(t, kind, topic, group)
	broker, err := bus.OpenBroker(ctx, b.Config(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { broker.Close() })
	require.NoError(t, broker.Provision(ctx, topic, group))
	return endToEnd{db: db, bus: b, cfg: b.Config(), broker: broker, topic: topic, got: collect(t, broker, topic, group)}
}

func crashConfig() forwarder.Config {
	return forwarder.Config{BatchSize: 200, MaxInFlight: 100, PollInterval: 100 * time.Millisecond,
		RetryInitial: 20 * time.Millisecond, RetryMax: 500 * time.Millisecond, ShutdownTimeout: 5 * time.Second}
}

// shardCrashConfig is crashConfig on n shards, with the backlog and
// unowned-shard gauges measured often.
func shardCrashConfig(n int) forwarder.Config {
	cfg := crashConfig()
	cfg.Shards = &n
	cfg.BacklogInterval = 50 * time.Millisecond
	return cfg
}

func startRelayProcess(t *testing.T, cfg bus.Config, kill string) *child.Process {
	return startNamedRelayProcess(t, cfg, kill, "")
}

// startNamedRelayProcess starts a relay child whose database sessions carry
// application_name name, so a test can see which relay holds the lease.
// extra adds to its environment (childShardsEnv, childMetrics).
func startNamedRelayProcess(t *testing.T, cfg bus.Config, kill, name string, extra ...string) *child.Process {
	t.Helper()
	return child.Start(t, child.Options{Role: relayRole, Env: append([]string{
		childAppEnv + "=" + name, childKindEnv + "=" + cfg.Broker.Kind, childSchemaEnv + "=" + cfg.Database.Schema,
		childKillEnv + "=" + kill, "NATS_URL=" + cfg.Broker.NATS.URL, "AMQP_URL=" + cfg.Broker.RabbitMQ.URL,
		"KAFKA_BROKERS=" + strings.Join(cfg.Broker.Kafka.Brokers, ","),
	}, extra...)})
}

// collector records every delivery of a consumer group.
type collector struct {
	mu     sync.Mutex
	count  map[string]int
	order  map[string][]int // aggregate -> versions in first-arrival order
	total  int
	ghosts int
}

func collect(t *testing.T, broker adapters.Broker, topic, group string) *collector {
	ch := brokertest.Subscribe(t, broker, topic, group)
	c := &collector{count: map[string]int{}, order: map[string][]int{}}
	go func() {
		for m := range ch {
			c.mu.Lock()
			agg := m.Metadata.Get(bus.AggregateIDKey)
			if strings.HasPrefix(agg, "ghost") {
				c.ghosts++
			}
			if c.count[m.UUID] == 0 {
				v, _ := strconv.Atoi(m.Metadata.Get(bus.AggregateVersionKey))
				c.order[agg] = append(c.order[agg], v)
			}
			c.count[m.UUID]++
			c.total++
			c.mu.Unlock()
			m.Ack()
		}
	}()
	return c
}

func (c *collector) distinct() int { c.mu.Lock(); defer c.mu.Unlock(); return len(c.count) }

// writer commits events of aggregates agg-0..agg-<aggregates-1> (20
// unless set) with increasing versions, ten per transaction, and every 25th
// transaction rolls back.
type writer struct {
	committed  map[string]bool
	version    map[string]int
	aggregates int
}

func newWriter() *writer {
	return &writer{committed: map[string]bool{}, version: map[string]int{}, aggregates: 20}
}

// write commits n more events.
func (w *writer) write(t *testing.T, b *bus.Bus, db *sql.DB, topic string, n int) {
	ctx := context.Background()
	version := w.version
	target := len(w.committed) + n
	for txn := 0; len(w.committed) < target; txn++ {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		rollback := txn%25 == 24
		var ids []string
		var events []bus.Event
		for i := range 10 {
			agg := fmt.Sprintf("agg-%d", (txn*10+i)%w.aggregates)
			if rollback {
				agg = "ghost-" + agg
			} else {
				version[agg]++
			}
			id := watermill.NewUUID()
			ids = append(ids, id)
			events = append(events, bus.Event{ID: id, Type: "Counted", AggregateType: "counter", AggregateID: agg,
				AggregateVersion: int64(version[agg]), Payload: []byte(`{}`)})
		}
		require.NoError(t, b.Publish(ctx, tx, topic, events...))
		if rollback {
			require.NoError(t, tx.Rollback())
			continue
		}
		require.NoError(t, tx.Commit())
		for _, id := range ids {
			w.committed[id] = true
		}
	}
}

// Relays killed with SIGKILL at random points (before a publish, after the
// broker confirmed a batch but before the ack, at a random moment mid-flow)
// while events are being committed: after a clean relay finishes, every
// committed event is on the broker at least once, none is pending, and no
// rolled-back event ever appears.
func TestRelayKilledAtRandomPointsLosesNothing(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testRelayCrashes)
}

func testRelayCrashes(t *testing.T, kind string) {
	const events, kills = 10_000, 10
	e := newEndToEnd(t, kind, "crash")
	db, b, cfg, broker, topic, got := e.db, e.bus, e.cfg, e.broker, e.topic, e.got

	written := make(chan *writer, 1)
	go func() { w := newWriter(); w.write(t, b, db, topic, events); written <- w }()

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	points := []string{"before-publish", "after-publish", "random"}
	killed := map[string]int{}
	for i := range kills {
		point := points[i%len(points)]
		kill := ""
		if point != "random" {
			kill = fmt.Sprintf("%s:%d", point, 1+rng.IntN(5))
		}
		proc := startRelayProcess(t, cfg, kill)
		if point == "random" {
			time.Sleep(time.Duration(50+rng.IntN(400)) * time.Millisecond)
			proc.Kill()
		}
		select {
		case <-proc.Done():
			require.True(t, proc.KilledBySIGKILL(), "relay %d was killed by SIGKILL at %s, not %v", i, point, proc.Err())
		case <-time.After(2 * time.Minute):
			t.Fatalf("relay %d (%s) never reached its kill point", i, kill)
		}
		killed[point]++
	}
	w := <-written

	clean := startRelayProcess(t, cfg, "")
	f, err := forwarder.New(db, broker, forwarder.Outbox{Schema: cfg.Database.Schema, Topic: cfg.Outbox.Topic}, crashConfig(), forwarder.Options{})
	require.NoError(t, err)
	testkit.Eventually(t, waitLimit, "the clean relay to finish", func() bool { return pending(t, f) == 0 })
	require.NoError(t, clean.Stop(waitLimit), "the clean relay stops gracefully")
	testkit.Eventually(t, waitLimit, "every committed event on the broker", func() bool { return got.distinct() >= len(w.committed) })

	got.checkDelivery(t, w)
	got.mu.Lock()
	defer got.mu.Unlock()
	t.Logf("%s: %d committed events, %d deliveries (%d duplicates) after %d kills %v",
		kind, len(w.committed), got.total, got.total-len(got.count), kills, killed)
}

// checkDelivery checks that exactly the events w committed reached the
// broker, each aggregate's versions in order.
func (c *collector) checkDelivery(t *testing.T, w *writer) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	for id := range w.committed {
		require.Positive(t, c.count[id], "committed event %s never reached the broker", id)
	}
	require.Len(t, c.count, len(w.committed), "only committed events reach the broker")
	require.Zero(t, c.ghosts, "an event of a rolled-back transaction reached the broker")
	for agg, versions := range c.order {
		for i := 1; i < len(versions); i++ {
			require.Greater(t, versions[i], versions[i-1], "%s: versions first arrived out of order: %v", agg, versions)
		}
	}
}

// activeRelay returns the application_name of the relay holding a live
// lease among relays whose name starts with prefix: the name of the direct
// notification session its lease is tied to.
func activeRelay(t *testing.T, db *sql.DB, schema, prefix string) string {
	var name sql.NullString
	err := db.QueryRow(`SELECT a.application_name FROM "`+schema+`".millrace_relay_cursors c
		JOIN pg_stat_activity a ON a.pid = c.holder_pid AND a.backend_start = c.holder_backend_start
		WHERE c.lease_until > clock_timestamp() AND a.application_name LIKE $1 || '%' LIMIT 1`, prefix).Scan(&name)
	if errors.Is(err, sql.ErrNoRows) {
		return ""
	}
	require.NoError(t, err)
	return name.String
}

// Two relays run at once: one is active, the other a hot standby; the
// active one is killed with SIGKILL mid-flow and the standby takes over.
// Nothing is lost and each aggregate's events first arrive in order.
func TestStandbyRelayTakesOverFromAKilledOne(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testTakeover)
}

func testTakeover(t *testing.T, kind string) {
	e := newEndToEnd(t, kind, "takeover")
	db, b, cfg, topic, got := e.db, e.bus, e.cfg, e.topic, e.got

	prefix := "relay" + cfg.Database.Schema[len(cfg.Database.Schema)-8:] // unique per test
	relays := map[string]*child.Process{}
	for _, name := range []string{prefix + "a", prefix + "b"} {
		relays[name] = startNamedRelayProcess(t, cfg, "", name)
	}
	var first string
	testkit.Eventually(t, waitLimit, "a relay to become active", func() bool { first = activeRelay(t, db, cfg.Database.Schema, prefix); return first != "" })

	w := newWriter()
	w.write(t, b, db, topic, 2000)
	testkit.Eventually(t, waitLimit, "some events forwarded", func() bool { return got.distinct() > 500 })
	require.Equal(t, first, activeRelay(t, db, cfg.Database.Schema, prefix), "only one relay is active; the other waits")
	relays[first].Kill()

	var second string
	// The lease is free once PostgreSQL sees the killed relay's notification
	// connection close.
	testkit.Eventually(t, waitLimit, "the standby to take over", func() bool {
		second = activeRelay(t, db, cfg.Database.Schema, prefix)
		return second != "" && second != first
	})
	w.write(t, b, db, topic, 2000)
	testkit.Eventually(t, waitLimit, "every committed event", func() bool { return got.distinct() >= len(w.committed) })

	got.mu.Lock()
	defer got.mu.Unlock()
	for id := range w.committed {
		require.Positive(t, got.count[id], "lost %s", id)
	}
	require.Zero(t, got.ghosts)
	for agg, versions := range got.order {
		for i := 1; i < len(versions); i++ {
			require.Greater(t, versions[i], versions[i-1], "%s: out of order: %v", agg, versions)
		}
	}
}
