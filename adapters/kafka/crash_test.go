package kafka_test

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// Environment of a dev cluster child process.
const (
	clusterChildDirEnv   = "MILLRACE_KAFKA_CLUSTER_DIR"
	clusterChildAddrsEnv = "MILLRACE_KAFKA_CLUSTER_ADDRS"
)

// runClusterChild runs a dev cluster on the addresses and data directory
// its environment names, says "ready" on stdout, and runs until it is
// killed or its parent goes away (stdin closes).
func runClusterChild() int {
	dc, err := kafkadev.Start(kafkadev.Options{
		Addrs:   strings.Split(os.Getenv(clusterChildAddrsEnv), ","),
		DataDir: os.Getenv(clusterChildDirEnv),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "dev cluster child:", err)
		return 1
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	dc.Close()
	return 0
}

// clusterProcess is a dev cluster in a process of its own, which a test can
// SIGKILL and start again on the same addresses with the data it had.
type clusterProcess struct {
	addrs   []string
	dataDir string
	cmd     *exec.Cmd
	stdin   io.Closer
}

// startClusterProcess starts a dev cluster child on three free ports below
// Linux's ephemeral range (32768 up), so that no outgoing connection of
// another process takes one while the cluster is down.
func startClusterProcess(t *testing.T, rng *rand.Rand) *clusterProcess {
	t.Helper()
	c := &clusterProcess{dataDir: t.TempDir()}
	for len(c.addrs) < 3 {
		addr := fmt.Sprintf("127.0.0.1:%d", 20000+rng.IntN(12000))
		if ln, err := net.Listen("tcp", addr); err == nil {
			require.NoError(t, ln.Close())
			c.addrs = append(c.addrs, addr)
		}
	}
	c.start(t)
	t.Cleanup(c.kill)
	return c
}

// start runs the child and waits until it listens. A port the killed
// cluster held may take a moment to come free; start tries again then.
func (c *clusterProcess) start(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), clusterChildDirEnv+"="+c.dataDir, clusterChildAddrsEnv+"="+strings.Join(c.addrs, ","))
		stdin, err := cmd.StdinPipe()
		require.NoError(t, err)
		stdout, err := cmd.StdoutPipe()
		require.NoError(t, err)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		require.NoError(t, cmd.Start())
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		if strings.TrimSpace(line) == "ready" {
			c.stdin = stdin // kept open: the child exits when the test process does
			c.cmd = cmd
			return
		}
		_ = cmd.Wait()
		require.True(t, time.Now().Before(deadline), "the dev cluster never started on %v: %s", c.addrs, stderr.String())
		time.Sleep(100 * time.Millisecond)
	}
}

// kill ends the cluster process with SIGKILL: nothing is saved on the way
// out, as in a crash.
func (c *clusterProcess) kill() {
	if c.cmd == nil {
		return
	}
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	_ = c.cmd.Wait()
	c.cmd = nil
}

// span is one PublishBatch call of the relay.
type span struct {
	start, end time.Time
	failed     bool
}

// timedBroker records the relay's PublishBatch calls, so the test can crash
// the cluster while one is under way and count what the crashes hit.
type timedBroker struct {
	*kafka.Broker
	inFlight atomic.Int32
	mu       sync.Mutex
	spans    []span
}

func (b *timedBroker) PublishBatch(ctx context.Context, msgs []adapters.Outgoing) error {
	b.inFlight.Add(1)
	defer b.inFlight.Add(-1)
	start := time.Now()
	err := b.Broker.PublishBatch(ctx, msgs)
	b.mu.Lock()
	b.spans = append(b.spans, span{start: start, end: time.Now(), failed: err != nil})
	b.mu.Unlock()
	return err
}

// waitForPublish returns once a PublishBatch call is under way: the relay
// publishes within moments of the writer's commits.
func (b *timedBroker) waitForPublish(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for b.inFlight.Load() == 0 {
		require.True(t, time.Now().Before(deadline), "the relay published nothing for a minute")
		time.Sleep(time.Millisecond)
	}
}

// TestRelayKeepsOrderAcrossClusterCrashes runs the relay against a dev
// cluster in its own process (three brokers, data on disk) while events of
// 32 aggregates are committed, and SIGKILLs the cluster three times, each
// time down for 2 to 5 seconds before it starts again on the same ports with
// its data. Reading the partition log afterwards: every committed event is
// there, and for each aggregate the first copy of each version comes after
// the first copy of every earlier version.
//
// Each crash comes while a publish is under way. With the default settings
// the producer rides out each outage; with a delivery timeout of 1s
// (producer_retries 4 x 250ms) and a producer_timeout of 1s, publishes give
// up during the outages and the relay sends their messages again.
func TestRelayKeepsOrderAcrossClusterCrashes(t *testing.T) {
	t.Parallel()
	t.Run("RiddenOut", func(t *testing.T) {
		t.Parallel()
		testOrderAcrossCrashes(t, kafka.Config{})
	})
	t.Run("FailedAndSentAgain", func(t *testing.T) {
		t.Parallel()
		testOrderAcrossCrashes(t, kafka.Config{ProducerRetries: 4, ProducerRetryBackoff: 250 * time.Millisecond, ProducerTimeout: time.Second})
	})
}

func testOrderAcrossCrashes(t *testing.T, kcfg kafka.Config) {
	ctx := context.Background()
	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 42))
	cluster := startClusterProcess(t, rng)
	t.Logf("seed %d, cluster on %v", seed, cluster.addrs)

	kcfg.Brokers = cluster.addrs
	db, pub, cfg := openCrashBus(t, kcfg)
	kb, err := kafka.Open(ctx, cfg.Broker.Kafka, adapters.Options{ConnectTimeout: 30 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, kb.Close()) })
	broker := &timedBroker{Broker: kb}
	topic := adaptertest.Name("crash-order")
	require.NoError(t, broker.Provision(ctx, topic))
	relay := startCrashRelay(t, db, broker, cfg)

	// The writer commits four events of random aggregates every 20ms until
	// told to stop, so the relay has work in every outage.
	w := &orderWriter{version: map[string]int{}, event: map[string]versioned{}}
	stopWriting := make(chan struct{})
	written := make(chan error, 1)
	go func() { written <- w.run(ctx, pub, db, topic, rand.New(rand.NewPCG(seed, 7)), stopWriting) }()
	outages := crashDuringPublishes(t, rng, broker, cluster)
	time.Sleep(time.Second)
	close(stopWriting)
	require.NoError(t, <-written)

	deadline := time.Now().Add(3 * time.Minute)
	for {
		rows, _, err := relay.Pending(ctx)
		if err == nil && rows == 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "the relay did not drain the outbox (%d rows pending, %v)", rows, err)
		time.Sleep(100 * time.Millisecond)
	}

	spans, failed, hit := broker.publishesIn(outages)
	firsts, copies := readPartitionLog(t, cluster.addrs, topic)
	lost := 0
	for id := range w.event {
		if _, ok := firsts[id]; !ok {
			lost++
		}
	}
	// Per aggregate, the versions in the order of their first copies.
	order := map[string][]versioned{}
	for _, f := range sortedFirsts(firsts) {
		ev, ok := w.event[f.id]
		require.True(t, ok, "the log holds event %s, which was never committed", f.id)
		order[ev.aggregate] = append(order[ev.aggregate], ev)
	}
	violations, brokenAggregates, example := orderViolations(order)
	t.Logf("%d events committed, %d records in the log (%d duplicates), %d publish calls (%d failed, %d under way in %d outages), %d lost, %d order violations in %d of %d aggregates",
		len(w.event), copies, copies-len(firsts), spans, failed, hit, len(outages), lost, violations, brokenAggregates, len(order))
	require.Zero(t, lost, "committed events missing from the partition log")
	require.Zero(t, violations, "a later version of an aggregate is in the log before an earlier one; e.g. %s", example)
}

// openCrashBus opens a Bus on a PostgreSQL cluster of its own, publishing
// to Kafka with kcfg: an old transaction open anywhere in a shared one
// would hide new outbox rows from the relay (the xid8 rule), so crashes
// could come while it had nothing to publish.
func openCrashBus(t *testing.T, kcfg kafka.Config) (*sql.DB, *bus.Bus, bus.Config) {
	ctx := context.Background()
	pg := servers.StartPostgreSQL(t)
	db, err := sql.Open("pgx", pg.URL)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	var cfg bus.Config
	cfg.Database.URL = pg.URL
	cfg.Database.Schema = testdb.Schema(t, db)
	cfg.Broker.Kind = bus.KindKafka
	cfg.Broker.Kafka = kcfg
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	pub, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })
	return db, pub, pub.Config()
}

// startCrashRelay runs a relay of cfg's outbox to broker until the test
// ends.
func startCrashRelay(t *testing.T, db *sql.DB, broker adapters.Broker, cfg bus.Config) *forwarder.Forwarder {
	relay, err := forwarder.New(db, broker, forwarder.Outbox{Schema: cfg.Database.Schema, Topic: cfg.Outbox.Topic},
		forwarder.Config{BatchSize: 500, MaxInFlight: 250, PollInterval: 100 * time.Millisecond,
			RetryInitial: 20 * time.Millisecond, RetryMax: 500 * time.Millisecond},
		forwarder.Options{})
	require.NoError(t, err)
	relayCtx, stopRelay := context.WithCancel(context.Background())
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	t.Cleanup(func() { stopRelay(); <-relayDone })
	return relay
}

// outage is when the cluster was down.
type outage struct{ killed, restarted time.Time }

// crashDuringPublishes kills the cluster three times in the middle of a
// publish and restarts it a few seconds later.
func crashDuringPublishes(t *testing.T, rng *rand.Rand, broker *timedBroker, cluster *clusterProcess) []outage {
	var outages []outage
	for range 3 {
		time.Sleep(time.Duration(1000+rng.IntN(1000)) * time.Millisecond)
		broker.waitForPublish(t) // crash in the middle of a publish
		cluster.kill()
		killed := time.Now()
		time.Sleep(time.Duration(2000+rng.IntN(3000)) * time.Millisecond)
		restarted := time.Now()
		cluster.start(t)
		outages = append(outages, outage{killed, restarted})
	}
	return outages
}

// publishesIn counts the publish calls, those that failed, and the
// outages during which a publish was under way (hit).
func (b *timedBroker) publishesIn(outages []outage) (calls, failed, hit int) {
	b.mu.Lock()
	spans := slices.Clone(b.spans)
	b.mu.Unlock()
	for _, s := range spans {
		if s.failed {
			failed++
		}
	}
	for _, o := range outages {
		if slices.ContainsFunc(spans, func(s span) bool { return s.start.Before(o.restarted) && s.end.After(o.killed) }) {
			hit++
		}
	}
	return len(spans), failed, hit
}

// orderViolations counts, in order (per aggregate, its events in the order
// of their first copies in the log), the events before an earlier version,
// and the aggregates with one, with an example.
func orderViolations(order map[string][]versioned) (violations, brokenAggregates int, example string) {
	for agg, evs := range order {
		broken := false
		for i := 1; i < len(evs); i++ {
			if evs[i].version < evs[i-1].version {
				violations++
				broken = true
				if example == "" {
					lo := max(0, i-3)
					example = fmt.Sprintf("%s: versions first in the log as %v", agg, versionsOf(evs[lo:min(len(evs), i+3)]))
				}
			}
		}
		if broken {
			brokenAggregates++
		}
	}
	return violations, brokenAggregates, example
}

// versioned is one committed event.
type versioned struct {
	aggregate string
	version   int
}

func versionsOf(evs []versioned) []int {
	out := make([]int, len(evs))
	for i, e := range evs {
		out[i] = e.version
	}
	return out
}

// orderWriter commits events of aggregates agg-00..agg-31 with increasing
// versions.
type orderWriter struct {
	version map[string]int
	event   map[string]versioned // committed event id -> aggregate and version
}

func (w *orderWriter) run(ctx context.Context, pub *bus.Bus, db *sql.DB, topic string, rng *rand.Rand, stop <-chan struct{}) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return nil
		case <-tick.C:
		}
		var events []bus.Event
		var evs []versioned
		for _, n := range rng.Perm(32)[:4] {
			agg := fmt.Sprintf("agg-%02d", n)
			v := w.version[agg] + 1
			events = append(events, bus.Event{ID: watermill.NewUUID(), Type: "Counted", AggregateType: "counter",
				AggregateID: agg, AggregateVersion: int64(v), Payload: []byte(`{}`)})
			evs = append(evs, versioned{aggregate: agg, version: v})
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if err := pub.Publish(ctx, tx, topic, events...); err != nil {
			_ = tx.Rollback()
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		for i, e := range events {
			w.version[evs[i].aggregate] = evs[i].version
			w.event[e.ID] = evs[i]
		}
	}
}

// logRecord is the first copy of an event in the partition log.
type logRecord struct {
	id        string
	partition int32
	offset    int64
}

func sortedFirsts(firsts map[string]logRecord) []logRecord {
	out := make([]logRecord, 0, len(firsts))
	for _, f := range firsts {
		out = append(out, f)
	}
	slices.SortFunc(out, func(a, b logRecord) int {
		if a.partition != b.partition {
			return int(a.partition - b.partition)
		}
		return int(a.offset - b.offset)
	})
	return out
}

// readPartitionLog reads every partition of topic from the start to its end
// with a plain consumer and returns the first copy of each event (by the
// message UUID header) and how many records the log holds.
func readPartitionLog(t *testing.T, brokers []string, topic string) (firsts map[string]logRecord, copies int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	require.NoError(t, err)
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListEndOffsets(ctx, topic)
	require.NoError(t, err)
	require.NoError(t, ends.Error())
	remaining := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			remaining[o.Partition] = o.Offset
		}
	})
	firsts = map[string]logRecord{}
	for len(remaining) > 0 {
		fetches := cl.PollFetches(ctx)
		require.NoError(t, ctx.Err(), "reading the partition log")
		fetches.EachError(func(_ string, p int32, err error) { require.NoError(t, err, "fetching partition %d", p) })
		fetches.EachRecord(func(r *kgo.Record) {
			copies++
			id := ""
			for _, h := range r.Headers {
				if h.Key == wkafka.UUIDHeaderKey {
					id = string(h.Value)
				}
			}
			if _, seen := firsts[id]; !seen {
				firsts[id] = logRecord{id: id, partition: r.Partition, offset: r.Offset}
			}
			if end, ok := remaining[r.Partition]; ok && r.Offset+1 >= end {
				delete(remaining, r.Partition)
			}
		})
	}
	return firsts, copies
}
