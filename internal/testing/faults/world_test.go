package faults

import (
	"context"
	"database/sql"
	"encoding/json"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit/child"
	"github.com/millrace-io/millrace/internal/testing/testlog"
	"github.com/millrace-io/millrace/middleware"
)

// world is one scenario on one broker: its own schema, topic and consumer
// group, a service that commits events (writer), and node processes.
type world struct {
	t       *testing.T
	kind    string
	cfg     bus.Config // what the nodes run with
	db      *sql.DB    // the service's and the checks' pool
	bus     *bus.Bus
	topic   string
	handler string
	writer  *writer

	mu        sync.Mutex
	lastFault time.Time
	faults    int
	nodes     []*node
}

// worldOptions place a world on servers of its own.
type worldOptions struct {
	databaseURL string // a private PostgreSQL; default: the shared one
	brokerURL   string // a private RabbitMQ or NATS server
	// unordered runs the consumers with consumer.ordered off, for the
	// scenarios that do not check order: on NATS an ordered handler has one
	// message in flight, on Kafka one per partition and on RabbitMQ one per
	// aggregate, so unordered ones form larger batches.
	unordered bool
	tune      func(*bus.Config) // scenario-specific settings
}

// Group commit is on in every scenario: up to batchMessages messages in one
// inbox transaction, waiting at most batchWait for more.
const (
	batchWorkers  = 16
	batchMessages = 16
	batchWait     = 5 * time.Millisecond
)

func newWorld(t *testing.T, kind string, opts worldOptions) *world {
	t.Helper()
	ctx := context.Background()
	var cfg bus.Config
	cfg.Database.URL = testdb.URL()
	if opts.databaseURL != "" {
		cfg.Database.URL = opts.databaseURL
	}
	brokertest.Apply(t, kind, &cfg)
	switch {
	case opts.brokerURL != "" && kind == bus.KindNATS:
		cfg.Broker.NATS.URL = opts.brokerURL
	case opts.brokerURL != "" && kind == bus.KindRabbitMQ:
		cfg.Broker.RabbitMQ.URL = opts.brokerURL
	}
	cfg.Relay = forwarder.Config{BatchSize: 200, MaxInFlight: 200, PollInterval: 200 * time.Millisecond,
		RetryInitial: 50 * time.Millisecond, RetryMax: time.Second, ShutdownTimeout: 5 * time.Second}
	cfg.Consumer.Ordered = new(!opts.unordered)
	cfg.Consumer.Workers = batchWorkers
	cfg.Consumer.Batch = middleware.BatchConfig{MaxMessages: batchMessages, MaxWait: batchWait}
	cfg.Consumer.Retry = middleware.RetryConfig{MaxAttempts: 5, InitialInterval: 50 * time.Millisecond,
		MaxInterval: 500 * time.Millisecond, MaxElapsed: time.Minute}
	cfg.Consumer.Breaker = middleware.BreakerConfig{Enabled: new(true), ConsecutiveFailures: 5,
		OpenTimeout: time.Second, HalfOpenRequests: 1}
	// A killed consumer's messages come back after these.
	cfg.Broker.NATS.Consumer.AckWait = 5 * time.Second
	cfg.Broker.NATS.Consumer.NakDelay = 100 * time.Millisecond
	cfg.Broker.Kafka.SessionTimeout = 6 * time.Second
	cfg.Broker.Kafka.HeartbeatInterval = 2 * time.Second
	cfg.Broker.Kafka.RebalanceTimeout = 10 * time.Second
	if opts.tune != nil {
		opts.tune(&cfg)
	}

	db, err := bus.OpenDB(cfg.Database)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	if opts.databaseURL == "" {
		cfg.Database.Schema = testdb.Schema(t, db)
	} else { // the private server goes away with the test
		cfg.Database.Schema = testdb.UniqueName(t.Name())
		_, err := db.Exec(`CREATE SCHEMA "` + cfg.Database.Schema + `"`)
		require.NoError(t, err)
	}
	cfg = cfg.WithDefaults()
	require.NoError(t, cfg.Validate())
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	// xid is the effect's transaction (the top-level one, also from a
	// batch member's savepoint): effects per xid are messages per batch.
	// applied_at is when the effect was written, for the commit-to-effect
	// latency.
	_, err = db.Exec(`CREATE TABLE "` + cfg.Database.Schema + `".effects (
		seq BIGSERIAL PRIMARY KEY, event_id TEXT NOT NULL, aggregate_id TEXT NOT NULL, version BIGINT NOT NULL, pid INT NOT NULL,
		xid xid8 NOT NULL DEFAULT pg_current_xact_id(), applied_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	_, err = db.Exec(`CREATE TABLE "` + cfg.Database.Schema + `".failed_attempts (event_id TEXT PRIMARY KEY)`)
	require.NoError(t, err)
	b, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })

	w := &world{t: t, kind: kind, cfg: cfg, db: db, bus: b}
	name := testdb.UniqueName("")[2:]
	w.topic, w.handler = "faults"+name, "effects"+name
	// The consumer group's topology exists before the first event is
	// relayed, whichever node starts first.
	broker, err := bus.OpenBroker(ctx, cfg, nil)
	require.NoError(t, err)
	if broker.Capabilities().OrderedGroups && *cfg.Consumer.Ordered {
		require.NoError(t, broker.ProvisionGroup(ctx, w.topic, adapters.GroupSpec{Name: w.handler, Start: adapters.StartAll, Ordered: true})) // as bus.Run does for an ordered handler
	} else {
		require.NoError(t, broker.Provision(ctx, w.topic, w.handler))
	}
	require.NoError(t, broker.Close())
	if opts.brokerURL == "" {
		brokertest.Cleanup(t, kind, w.topic, w.handler)
	}
	w.writer = newWriter(w)
	return w
}

// fault notes that a fault was injected now.
func (w *world) fault() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.faults++
	w.lastFault = time.Now()
}

// node is a child process running the relay, the consumer or both.
type node struct {
	t      *testing.T
	name   string
	proc   *child.Process
	stderr *testlog.Buffer
	// stopped says the scenario ended the node (or the node's own kill
	// point did): its exit is no failure.
	stopped atomic.Bool
}

// start runs a node; spec's Config, Topic and Handler are filled in.
func (w *world) start(name string, spec nodeSpec) *node {
	w.t.Helper()
	spec.Config, spec.Topic, spec.Handler = w.cfg, w.topic, w.handler
	raw, err := json.Marshal(spec)
	require.NoError(w.t, err)
	n := &node{t: w.t, name: name, stderr: &testlog.Buffer{}}
	n.proc = child.Start(w.t, child.Options{Role: nodeRole, Env: []string{nodeEnv + "=" + string(raw)}, Stderr: n.stderr})
	w.mu.Lock()
	w.nodes = append(w.nodes, n)
	w.mu.Unlock()
	w.t.Cleanup(func() {
		n.kill()
		if w.t.Failed() && n.stderr.Len() > 0 {
			w.t.Logf("node %s stderr:\n%s", name, tail(withoutDumps(n.stderr.String()), 4000))
		}
	})
	return n
}

// kill SIGKILLs the node and waits for it to end.
func (n *node) kill() {
	n.stopped.Store(true)
	n.proc.Kill()
}

// term sends SIGTERM and returns how long the node took to exit and how;
// a node still running after limit is killed.
func (n *node) term(limit time.Duration) (time.Duration, error) {
	began := time.Now()
	n.stopped.Store(true)
	err := n.proc.Stop(limit)
	return time.Since(began), err
}

// nodesAlive fails the test when a node the scenario did not stop has
// exited: a node must ride out every fault without manual action.
func (w *world) nodesAlive() {
	w.t.Helper()
	for _, n := range w.snapshot() {
		select {
		case <-n.proc.Done():
			if !n.stopped.Load() {
				w.t.Fatalf("node %s exited by itself (%v):\n%s", n.name, n.proc.Err(), tail(n.stderr.String(), 3000))
			}
		default:
		}
	}
}

// flowing waits until n events have an effect: the nodes are up and
// working, so a fault injected next hits them mid-flow.
func (w *world) flowing(n int) {
	w.t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var effects int
		if w.db.QueryRow(`SELECT count(*) FROM `+w.table("effects")).Scan(&effects) == nil && effects >= n {
			return
		}
		w.nodesAlive()
		if time.Now().After(deadline) {
			w.t.Fatalf("the flow did not start: %d of %d effects after 2m; outbox: %s; relay cursor: %s", effects, n, w.outboxState(), w.cursorState())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// moreEffects waits until n more effects than now were applied: the flow
// goes on (during a fault, or after it).
func (w *world) moreEffects(n int) {
	w.t.Helper()
	var effects int
	require.NoError(w.t, w.db.QueryRow(`SELECT count(*) FROM `+w.table("effects")).Scan(&effects))
	w.flowing(effects + n)
}

// snapshot returns the nodes started so far.
func (w *world) snapshot() []*node {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.nodes)
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}
