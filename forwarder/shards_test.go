package forwarder_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

func shardedConfig(n int) forwarder.Config {
	cfg := testConfig()
	cfg.Shards = &n
	cfg.BacklogInterval = 50 * time.Millisecond
	return cfg
}

// owned sums the shard_owned gauges of a relay's registry.
func owned(t *testing.T, reg *prometheus.Registry) int {
	return int(metricValue(t, reg, "millrace_relay_shard_owned"))
}

// Three relays on eight shards spread them (3, 3, 2); when one stops, the
// two others take its shards; every event arrives exactly once and in
// order per aggregate, also one whose row has no aggregate id (shard 0).
func TestShardedRelaysSpreadTheShardsAndTakeOverAStoppedOne(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	regs := make([]*prometheus.Registry, 3)
	stops := make([]context.CancelFunc, 3)
	for i := range regs {
		regs[i] = prometheus.NewRegistry()
		_, stops[i] = start(t, tb, broker, shardedConfig(8), regs[i])
	}
	testkit.Eventually(t, waitLimit, "the shards spread over three relays", func() bool {
		a, b, c := owned(t, regs[0]), owned(t, regs[1]), owned(t, regs[2])
		return a+b+c == 8 && min(a, b, c) >= 2 && metricValue(t, regs[0], "millrace_relay_unowned_shards") == 0
	})

	events := interleaved(200, 5)
	publish(t, tb, "things", events[:500], 10)
	// A row written without an aggregate id goes to shard 0.
	msg := message.NewMessage("no-aggregate", []byte(`{}`))
	payload, err := envelope.Wrap("things", msg)
	require.NoError(t, err)
	tx, err := tb.db.Begin()
	require.NoError(t, err)
	tables := store.Tables{Schema: tb.outbox.Schema, OutboxTopic: tb.outbox.Topic}
	require.NoError(t, tables.WriteOutbox(context.Background(), tx, []*message.Message{message.NewMessage(msg.UUID, payload)}))
	require.NoError(t, tx.Commit())

	testkit.Eventually(t, waitLimit, "the first events", func() bool { return len(broker.snapshot()) >= 501 })
	stops[0]()
	testkit.Eventually(t, waitLimit, "the two others own every shard", func() bool {
		return owned(t, regs[0]) == 0 && owned(t, regs[1])+owned(t, regs[2]) == 8 &&
			metricValue(t, regs[1], "millrace_relay_unowned_shards") == 0
	})
	publish(t, tb, "things", events[500:], 10)
	testkit.Eventually(t, waitLimit, "every event", func() bool { return len(broker.snapshot()) >= len(events)+1 })

	var got []adapters.Outgoing
	for _, o := range broker.snapshot() {
		if o.Msg.UUID == msg.UUID {
			continue
		}
		got = append(got, o)
	}
	require.Len(t, got, len(events), "each event once: shards move only after their batch is acked")
	checkOrder(t, got, 200, 5)
	f, err := forwarder.New(tb.db, broker, tb.outbox, shardedConfig(8), forwarder.Options{})
	require.NoError(t, err)
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })
	require.Equal(t, 1.0, metricValue(t, regs[1], "millrace_relay_active"))

	// The ops API (`millrace outbox status`) shows the shards, their owners
	// (the two running relays) and their backlog.
	st := outboxStatus(t, tb)
	require.Equal(t, 8, st.Shards)
	require.Zero(t, st.Pending)
	require.EqualValues(t, len(events)+1, st.Forwarded)
	require.Len(t, st.ShardStates, 8)
	owners := map[string]int{}
	for i, s := range st.ShardStates {
		require.Equal(t, i, s.Shard)
		require.NotEmpty(t, s.Owner, "shard %d has an owner", i)
		require.Zero(t, s.Pending)
		owners[s.Owner]++
	}
	require.Len(t, owners, 2, "the two running relays own the shards: %v", owners)
}

// A sharded relay is woken by the notification of each shard: with
// poll_interval an hour, events of 40 aggregates (all four shards), each
// committed alone, still arrive.
func TestShardedRelayWakesOnEachShardsNotify(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	cfg := shardedConfig(4)
	cfg.PollInterval = time.Hour // only NOTIFY can wake the shards
	reg := prometheus.NewRegistry()
	start(t, tb, broker, cfg, reg)
	testkit.Eventually(t, waitLimit, "the relay owns the four shards", func() bool { return owned(t, reg) == 4 })
	time.Sleep(100 * time.Millisecond) // let the shard relays finish their start-up batch and go idle
	events := interleaved(40, 1)
	publish(t, tb, "things", events, 1)
	testkit.Eventually(t, waitLimit, "every event, woken by its shard's NOTIFY", func() bool { return len(broker.snapshot()) == len(events) })
}

// With eight shards and no relay running, the outbox status counts each
// shard's backlog and shows no owner.
func TestOutboxStatusShowsEachShardsBacklog(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tables := store.Tables{Schema: tb.outbox.Schema, OutboxTopic: tb.outbox.Topic}
	require.NoError(t, tables.RecordShards(context.Background(), tb.db, tb.cfg.Relay.ConsumerGroup, 8))
	publish(t, tb, "things", interleaved(50, 2), 10)
	st := outboxStatus(t, tb)
	require.Equal(t, 8, st.Shards)
	require.EqualValues(t, 100, st.Pending)
	require.Positive(t, st.OldestPendingAge)
	total, busy := int64(0), 0
	for _, s := range st.ShardStates {
		require.Empty(t, s.Owner)
		require.Zero(t, s.Pending%2, "shard %d: both versions of an aggregate are in one shard", s.Shard)
		total += s.Pending
		if s.Pending > 0 {
			busy++
		}
	}
	require.EqualValues(t, 100, total)
	require.Greater(t, busy, 4, "50 aggregates spread over the shards")
}

// A relay started with another relay.shards over pending rows refuses to
// start, naming the key and the procedure; after the rows are forwarded
// under the old count, it starts and records the new one.
func TestChangingShardsWithRowsPendingRefusesToStart(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	publish(t, tb, "things", interleaved(4, 3), 4)

	f, err := forwarder.New(tb.db, newMemoryBroker(), tb.outbox, shardedConfig(4), forwarder.Options{})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	err = f.Run(ctx)
	require.True(t, errors.Is(err, forwarder.ErrShardsChanged), "%v", err)
	for _, want := range []string{"relay.shards: 4", "12 rows pending under 1 shards", "docs/SHARDS.md",
		"stop every relay of the outbox", "0 pending", "start them with the new relay.shards"} {
		require.ErrorContains(t, err, want)
	}

	broker := newMemoryBroker()
	one, stopOne := start(t, tb, broker, testConfig(), nil)
	testkit.Eventually(t, waitLimit, "drained under one shard", func() bool { return pending(t, one) == 0 })
	stopOne()
	four, _ := start(t, tb, broker, shardedConfig(4), nil)
	// Rows written before the count is recorded would be pending under one
	// shard again: the writers wait, as the procedure says.
	testkit.Eventually(t, waitLimit, "four shards recorded and owned", func() bool { return four.Status().Role == forwarder.RoleActive })
	publish(t, tb, "things", interleaved(4, 6)[12:], 4)
	testkit.Eventually(t, waitLimit, "the rest under four shards", func() bool { return len(broker.snapshot()) >= 24 })
	checkOrder(t, broker.snapshot(), 4, 6)
}

// setupWAL is setup on a private PostgreSQL with wal_level = logical, for
// a relay with relay.source: wal; it returns the replication URL too.
func setupWAL(t *testing.T) (bundle, string) {
	t.Helper()
	url := servers.StartLogicalPostgreSQL(t).URL
	var cfg bus.Config
	cfg.Database.URL = url
	cfg.Database.Schema = testdb.UniqueName("lanes")
	cfg.Relay.Source = forwarder.SourceWAL
	brokertest.Apply(t, bus.KindNATS, &cfg)
	svc := &brokertest.Service{DB: testdb.OpenURL(t, url), Config: cfg}
	require.NoError(t, bus.Migrate(context.Background(), svc.DB, cfg))
	b := svc.Open(t)
	cfg = b.Config()
	return bundle{db: svc.DB, bus: b, cfg: cfg, outbox: forwarder.Outbox{Schema: cfg.Database.Schema, Topic: cfg.Outbox.Topic}}, url
}

// A WAL relay with relay.shards: 4 reads its one slot and publishes each
// batch in four lanes at once, by aggregate: the broker gets two batches
// of the relay at the same time, every event arrives once and in order per
// aggregate, and the rows committed before the slot (forwarded by the
// catch-up, which reads the outbox table as one shard) arrive too.
func TestWALRelayPublishesItsShardsInLanesAtOnce(t *testing.T) {
	t.Parallel()
	tb, url := setupWAL(t)
	events := interleaved(16, 30)
	publish(t, tb, "things", events[:80], 10) // before the slot: the catch-up's
	cfg := shardedConfig(4)
	cfg.Source = forwarder.SourceWAL
	broker := newMemoryBroker()
	f, err := forwarder.New(tb.db, broker, tb.outbox, cfg, forwarder.Options{ReplicationURL: url})
	require.NoError(t, err)
	// Once the stream's batches come, a publish waits (at most waitLimit)
	// for a second one to be in flight beside it.
	var streaming atomic.Bool
	var inFlight atomic.Int32
	overlapped := make(chan struct{})
	var once sync.Once
	forwarder.SetBeforePublish(f, func(int) {
		if inFlight.Add(1) >= 2 {
			once.Do(func() { close(overlapped) })
		}
		if streaming.Load() {
			select {
			case <-overlapped:
			case <-time.After(waitLimit):
			}
		}
	})
	forwarder.SetAfterPublish(f, func(int) { inFlight.Add(-1) })
	run(t, f)

	testkit.Eventually(t, waitLimit, "the catch-up's events", func() bool { return len(broker.snapshot()) >= 80 })
	streaming.Store(true)
	publish(t, tb, "things", events[80:], 10)
	testkit.Eventually(t, waitLimit, "every event", func() bool { return len(broker.snapshot()) >= len(events) })
	select {
	case <-overlapped:
	default:
		t.Fatal("no two publishes of the relay were in flight at once")
	}
	got := broker.snapshot()
	require.Len(t, got, len(events), "each event once")
	checkOrder(t, got, 16, 30)
	testkit.Eventually(t, waitLimit, "the forwarded rows deleted", func() bool { return pending(t, f) == 0 })
}
