package forwarder_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/ops"
)

// memoryBroker records what it is asked to publish; fail decides per message
// whether to refuse it. The relay's database side is what these tests check;
// the broker side is covered with real brokers in the integration tests.
type memoryBroker struct {
	mu        sync.Mutex
	published []adapters.Outgoing
	calls     int
	fail      func(call int, m adapters.Outgoing) error
	refuse    func(topic string) error // Provision's answer
	arrived   chan struct{}
}

func newMemoryBroker() *memoryBroker { return &memoryBroker{arrived: make(chan struct{}, 1)} }

func (b *memoryBroker) PublishBatch(ctx context.Context, msgs []adapters.Outgoing) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls++
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if b.fail != nil {
			errs[i] = b.fail(b.calls, m)
		}
		if errs[i] == nil {
			b.published = append(b.published, m)
		}
	}
	select {
	case b.arrived <- struct{}{}:
	default:
	}
	return adapters.NewBatchError(errs)
}

func (b *memoryBroker) Provision(_ context.Context, topic string, _ ...string) error {
	if b.refuse != nil {
		return b.refuse(topic)
	}
	return nil
}

func (b *memoryBroker) snapshot() []adapters.Outgoing {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]adapters.Outgoing(nil), b.published...)
}

func (b *memoryBroker) callCount() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.calls
}

type bundle struct {
	db     *sql.DB
	bus    *bus.Bus
	cfg    bus.Config
	outbox forwarder.Outbox
}

func setup(t *testing.T) bundle {
	t.Helper()
	svc := brokertest.NewService(t, bus.KindNATS)
	b := svc.Open(t)
	cfg := b.Config()
	return bundle{db: svc.DB, bus: b, cfg: cfg, outbox: forwarder.Outbox{Schema: cfg.Database.Schema, Topic: cfg.Outbox.Topic}}
}

func testConfig() forwarder.Config {
	return forwarder.Config{
		BatchSize:       100,
		MaxInFlight:     100,
		PollInterval:    50 * time.Millisecond,
		RetryInitial:    20 * time.Millisecond,
		RetryMax:        200 * time.Millisecond,
		ShutdownTimeout: 2 * time.Second,
	}
}

// start runs a relay until the test ends and returns it.
func start(t *testing.T, tb bundle, broker forwarder.Broker, cfg forwarder.Config, reg prometheus.Registerer) (*forwarder.Forwarder, context.CancelFunc) {
	t.Helper()
	f, err := forwarder.New(tb.db, broker, tb.outbox, cfg, forwarder.Options{Registerer: reg})
	require.NoError(t, err)
	return f, run(t, f)
}

// run runs f until the test ends or the returned cancel is called; f must
// stop cleanly.
func run(t *testing.T, f *forwarder.Forwarder) context.CancelFunc {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("relay did not stop")
		}
	})
	return cancel
}

func event(aggregate string, version int) bus.Event {
	return bus.Event{
		Type: "Changed", AggregateType: "thing", AggregateID: aggregate, AggregateVersion: int64(version),
		Payload: []byte(`{"v":` + strconv.Itoa(version) + `}`),
	}
}

// publish commits events in transactions of perTx events each.
func publish(t *testing.T, tb bundle, topic string, events []bus.Event, perTx int) {
	t.Helper()
	for start := 0; start < len(events); start += perTx {
		require.NoError(t, tb.bus.PublishInOwnTx(context.Background(), topic, events[start:min(start+perTx, len(events))]...))
	}
}

// waitLimit bounds every wait in these tests: generous, the machine may be
// busy with other packages.
const waitLimit = 3 * time.Minute

func pending(t *testing.T, f *forwarder.Forwarder) int64 {
	n, _, err := f.Pending(context.Background())
	require.NoError(t, err)
	return n
}

// checkOrder asserts each aggregate's versions arrive as 1, 2, 3, ... with
// every event present.
func checkOrder(t *testing.T, got []adapters.Outgoing, aggregates, versions int) {
	t.Helper()
	last := map[string]int{}
	for _, o := range got {
		agg := o.Msg.Metadata.Get(bus.AggregateIDKey)
		v, err := strconv.Atoi(o.Msg.Metadata.Get(bus.AggregateVersionKey))
		require.NoError(t, err)
		require.Equal(t, last[agg]+1, v, "aggregate %s: version %d after %d", agg, v, last[agg])
		last[agg] = v
	}
	require.Len(t, last, aggregates)
	for agg, v := range last {
		require.Equal(t, versions, v, agg)
	}
}

// sequence is aggregate's events 1 to n, in order.
func sequence(aggregate string, n int) []bus.Event {
	events := make([]bus.Event, 0, n)
	for v := 1; v <= n; v++ {
		events = append(events, event(aggregate, v))
	}
	return events
}

// failOnce is a memoryBroker.fail that refuses each event of one of the
// given aggregate versions once, retryably, and takes everything else.
func failOnce(versions ...string) func(int, adapters.Outgoing) error {
	failed := map[string]bool{}
	return func(_ int, m adapters.Outgoing) error {
		if slices.Contains(versions, m.Msg.Metadata.Get(bus.AggregateVersionKey)) && !failed[m.Msg.UUID] {
			failed[m.Msg.UUID] = true
			return errors.New("broker hiccup")
		}
		return nil
	}
}

func interleaved(aggregates, versions int) []bus.Event {
	var events []bus.Event
	for v := 1; v <= versions; v++ {
		for a := range aggregates {
			events = append(events, event(fmt.Sprintf("agg-%d", a), v))
		}
	}
	return events
}

func TestForwardsCommittedEventsInCommitOrder(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	reg := prometheus.NewRegistry()
	f, _ := start(t, tb, broker, testConfig(), reg)

	events := interleaved(20, 50)
	publish(t, tb, "things", events, 7)
	// A rolled-back transaction never reaches the broker.
	tx, err := tb.db.Begin()
	require.NoError(t, err)
	require.NoError(t, tb.bus.Publish(context.Background(), tx, "things", event("ghost", 1)))
	require.NoError(t, tx.Rollback())

	testkit.Eventually(t, waitLimit, "every event", func() bool { return len(broker.snapshot()) >= len(events) })
	got := broker.snapshot()
	require.Len(t, got, len(events), "each event exactly once when nothing fails")
	checkOrder(t, got, 20, 50)
	for _, o := range got {
		require.Equal(t, "things", o.Topic)
		require.Equal(t, o.Msg.UUID, o.Msg.Metadata.Get(bus.EventIDKey), "the message UUID is the event id")
	}
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })
	require.Equal(t, float64(len(events)), metricValue(t, reg, "millrace_relay_messages_forwarded_total"))
}

// outboxStatus is what the ops API (`millrace outbox status`) says of tb's
// outbox.
func outboxStatus(t *testing.T, tb bundle) ops.OutboxStatus {
	t.Helper()
	oc, err := ops.New(context.Background(), tb.db, tb.cfg)
	require.NoError(t, err)
	st, err := oc.OutboxStatus(context.Background(), "")
	require.NoError(t, err)
	return st
}

// metricValue sums the values of a gathered counter or gauge.
func metricValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range families {
		if mf.GetName() != name {
			continue
		}
		v := 0.0
		for _, m := range mf.GetMetric() {
			v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
		return v
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}

func TestWakesOnNotifyWithoutPolling(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	cfg := testConfig()
	cfg.PollInterval = time.Hour // only NOTIFY can wake it
	start(t, tb, broker, cfg, nil)
	testkit.Eventually(t, waitLimit, "the first empty poll", func() bool { return broker.callCount() == 0 && true })
	time.Sleep(100 * time.Millisecond) // let the relay finish its start-up batch and go idle
	publish(t, tb, "things", []bus.Event{event("a", 1)}, 1)
	testkit.Eventually(t, waitLimit, "the event, woken by NOTIFY", func() bool { return len(broker.snapshot()) == 1 })
}

func TestPartialBatchAcksConfirmedPrefixAndRetriesTheRest(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	// The 30th event fails once, retryably; later ones in its batch succeed.
	broker.fail = failOnce("30")
	publish(t, tb, "things", sequence("a", 60), 60)
	f, _ := start(t, tb, broker, testConfig(), nil)
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })

	count := map[string]int{}
	for _, o := range broker.snapshot() {
		count[o.Msg.Metadata.Get(bus.AggregateVersionKey)]++
	}
	for v := 1; v <= 60; v++ {
		require.GreaterOrEqual(t, count[strconv.Itoa(v)], 1, "version %d lost", v)
		if v < 30 {
			require.Equal(t, 1, count[strconv.Itoa(v)], "version %d before the failure was acked, not re-sent", v)
		}
	}
	require.Equal(t, 2, count["31"], "versions after the failure are re-sent from the first unconfirmed one")
}

func TestUnreadableRowsAreQuarantinedAndDoNotBlock(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	broker.fail = func(_ int, m adapters.Outgoing) error {
		if m.Msg.Metadata.Get(bus.AggregateIDKey) == "huge" {
			return adapters.Permanent(fmt.Errorf("%w: limit is 1048576 bytes", adapters.ErrMessageTooLarge))
		}
		return nil
	}
	publish(t, tb, "things", []bus.Event{event("a", 1)}, 1)
	table := `"` + tb.outbox.Schema + `"."watermill_` + tb.outbox.Topic + `"`
	for _, corrupt := range []string{`"not an envelope"`, `{"uuid":"x","payload":"e30="}`} {
		_, err := tb.db.Exec(`INSERT INTO `+table+` (uuid, payload, metadata, transaction_id) VALUES ($1, $2, '{}', pg_current_xact_id())`,
			"corrupt-row", corrupt)
		require.NoError(t, err)
	}
	publish(t, tb, "things", []bus.Event{event("huge", 1), event("a", 2), event("a", 3)}, 3)

	f, _ := start(t, tb, broker, testConfig(), nil)
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })

	var versions []string
	for _, o := range broker.snapshot() {
		versions = append(versions, o.Msg.Metadata.Get(bus.AggregateIDKey)+"/"+o.Msg.Metadata.Get(bus.AggregateVersionKey))
	}
	require.Equal(t, []string{"a/1", "a/2", "a/3"}, versions, "rows behind the bad ones keep flowing")

	reasons := testdb.Column[string](t, tb.db, `SELECT reason FROM "`+tb.outbox.Schema+`".millrace_relay_quarantine ORDER BY id`)
	require.Len(t, reasons, 3)
	require.Contains(t, reasons[0], "not valid JSON")
	require.Contains(t, reasons[1], "no destination_topic")
	require.Contains(t, reasons[2], "1048576")
}

func TestBrokerOutageBacksOffAndResumes(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	var mu sync.Mutex
	down := true
	broker.fail = func(int, adapters.Outgoing) error {
		mu.Lock()
		defer mu.Unlock()
		if down {
			return errors.New("connection refused")
		}
		return nil
	}
	publish(t, tb, "things", interleaved(5, 10), 10)
	cfg := testConfig()
	cfg.RetryInitial = 50 * time.Millisecond
	cfg.RetryMax = 400 * time.Millisecond
	f, _ := start(t, tb, broker, cfg, nil)
	testkit.Eventually(t, waitLimit, "a few failed attempts", func() bool { return broker.callCount() >= 4 })
	time.Sleep(time.Second)
	attempts := broker.callCount()
	// Backing off from 50ms towards 400ms, one second of outage allows at most
	// a handful of attempts; a hot loop would make thousands.
	require.Less(t, attempts, 30, "the relay spun while the broker was down")
	require.EqualValues(t, 50, pending(t, f), "nothing is acked while the broker is down")

	mu.Lock()
	down = false
	mu.Unlock()
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })
	checkOrder(t, broker.snapshot(), 5, 10)
}

func TestStopDoesNotAckUnconfirmedBatch(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	publish(t, tb, "things", interleaved(4, 5), 20)
	blocked := &blockingBroker{entered: make(chan struct{}, 1)}
	cfg := testConfig()
	cfg.ShutdownTimeout = 300 * time.Millisecond
	f, err := forwarder.New(tb.db, blocked, tb.outbox, cfg, forwarder.Options{})
	require.NoError(t, err)
	running := testkit.Start(t, f.Run)
	<-blocked.entered
	require.NoError(t, running.Stop(t, 30*time.Second), "the relay stops after its shutdown timeout")
	require.EqualValues(t, 20, pending(t, f), "the abandoned batch was not acked")

	broker := newMemoryBroker()
	start(t, tb, broker, testConfig(), nil)
	testkit.Eventually(t, waitLimit, "a new relay to forward all", func() bool { return len(broker.snapshot()) == 20 })
	checkOrder(t, broker.snapshot(), 4, 5)
}

// blockingBroker never confirms: PublishBatch waits until its context ends.
type blockingBroker struct{ entered chan struct{} }

func (b *blockingBroker) PublishBatch(ctx context.Context, msgs []adapters.Outgoing) error {
	select {
	case b.entered <- struct{}{}:
	default:
	}
	<-ctx.Done()
	return adapters.FailAll(len(msgs), ctx.Err())
}

func (b *blockingBroker) Provision(context.Context, string, ...string) error { return nil }

func TestStandbyTakesOverWhenTheActiveRelayStops(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	first, second := newMemoryBroker(), newMemoryBroker()
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	_, stopA := start(t, tb, first, testConfig(), regA)
	testkit.Eventually(t, waitLimit, "relay A active", func() bool { return metricValue(t, regA, "millrace_relay_active") == 1 })
	start(t, tb, second, testConfig(), regB)

	publish(t, tb, "things", interleaved(5, 20), 10)
	testkit.Eventually(t, waitLimit, "relay A forwards", func() bool { return len(first.snapshot()) == 100 })
	require.Zero(t, second.callCount(), "the standby publishes nothing while A is active")
	require.Zero(t, metricValue(t, regB, "millrace_relay_active"))

	stopA()
	testkit.Eventually(t, waitLimit, "relay B active", func() bool { return metricValue(t, regB, "millrace_relay_active") == 1 })
	more := interleaved(5, 40)[100:]
	publish(t, tb, "things", more, 10)
	testkit.Eventually(t, waitLimit, "relay B forwards", func() bool { return len(second.snapshot()) == len(more) })
	checkOrder(t, append(first.snapshot(), second.snapshot()...), 5, 40)
}

func TestRetentionDeletesForwardedRowsInBatches(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	cfg := testConfig()
	zero := time.Duration(0)
	cfg.Retention = &zero
	cfg.CleanupInterval = 50 * time.Millisecond
	cfg.CleanupBatch = 40
	f, _ := start(t, tb, broker, cfg, nil)

	count := func() int {
		var n int
		require.NoError(t, tb.db.QueryRow(`SELECT count(*) FROM "`+tb.outbox.Schema+`"."watermill_`+tb.outbox.Topic+`"`).Scan(&n))
		return n
	}
	peak := 0
	for round := range 10 {
		publish(t, tb, "things", interleaved(10, 30)[:300], 30)
		peak = max(peak, count())
		testkit.Eventually(t, waitLimit, "round forwarded", func() bool { return len(broker.snapshot()) == 300*(round+1) })
		testkit.Eventually(t, waitLimit, "round cleaned up", func() bool { return count() == 0 })
	}
	require.LessOrEqual(t, peak, 300, "the table never holds more than one round")
	n, err := f.DeleteForwarded(context.Background(), 0, 10)
	require.NoError(t, err)
	require.Zero(t, n)
}

func TestUnforwardedRowsAreNeverDeleted(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	publish(t, tb, "things", interleaved(3, 3), 3)
	f, err := forwarder.New(tb.db, newMemoryBroker(), tb.outbox, testConfig(), forwarder.Options{})
	require.NoError(t, err)
	n, err := f.DeleteForwarded(context.Background(), 0, 100)
	require.NoError(t, err)
	require.Zero(t, n, "no relay has forwarded anything yet")
	require.EqualValues(t, 9, pending(t, f))
}

func TestRateLimitBoundsTheDrain(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	publish(t, tb, "things", interleaved(10, 30), 100)
	broker := newMemoryBroker()
	cfg := testConfig()
	cfg.RateLimit = 200
	began := time.Now()
	f, _ := start(t, tb, broker, cfg, nil)
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })
	// 300 messages at 200/s with a burst of 20 cannot take less than 1.4s.
	require.GreaterOrEqual(t, time.Since(began), 1400*time.Millisecond)
	checkOrder(t, broker.snapshot(), 10, 30)
}

func TestRelaysRowsWrittenByPlainWatermill(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	msg := message.NewMessage("0b7d7e8e-2f5d-4a3e-8c61-3c2d1e0f9a8b", []byte(`{"legacy":true}`))
	msg.Metadata.Set("x-custom", "kept")
	brokertest.WriteOutboxWithWatermill(t, tb.db, tb.cfg, "legacy.events", msg)

	broker := newMemoryBroker()
	start(t, tb, broker, testConfig(), nil)
	testkit.Eventually(t, waitLimit, "the legacy row", func() bool { return len(broker.snapshot()) == 1 })
	got := broker.snapshot()[0]
	require.Equal(t, "legacy.events", got.Topic)
	require.Equal(t, msg.UUID, got.Msg.UUID)
	require.Equal(t, "kept", got.Msg.Metadata.Get("x-custom"))
	require.JSONEq(t, `{"legacy":true}`, string(got.Msg.Payload))
}

func TestConfigValidationNamesFields(t *testing.T) {
	t.Parallel()
	cfg := forwarder.Config{BatchSize: -1, RateLimit: -5, PollInterval: -time.Second, RetryInitial: time.Second, RetryMax: time.Millisecond}
	errs := cfg.WithDefaults().Validate("relay")
	var text []string
	for _, e := range errs {
		text = append(text, e.Error())
	}
	require.Len(t, errs, 4, text)
	require.Contains(t, text[0], "relay.batch_size")
}

// relay.shards below 1 or above the limit is refused, naming the key;
// counts in between are accepted.
func TestShardsValidationNamesTheKey(t *testing.T) {
	t.Parallel()
	for _, n := range []int{0, -3} {
		errs := forwarder.Config{Shards: &n}.WithDefaults().Validate("relay")
		require.Len(t, errs, 1)
		require.ErrorContains(t, errs[0], fmt.Sprintf("relay.shards: must be at least 1 (1 is one active relay for the whole outbox); got %d", n))
	}
	tooMany := 257
	errs := forwarder.Config{Shards: &tooMany}.WithDefaults().Validate("relay")
	require.Len(t, errs, 1)
	require.ErrorContains(t, errs[0], "relay.shards: must be at most 256; got 257")
	for _, n := range []int{2, 8, 256} {
		require.Empty(t, forwarder.Config{Shards: &n}.WithDefaults().Validate("relay"), n)
	}
	require.Empty(t, forwarder.Config{}.WithDefaults().Validate("relay"), "unset is 1")
	require.Equal(t, 1, *forwarder.Config{}.WithDefaults().Shards)
}

func TestOutboxStatusReportsTheOutboxState(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	publish(t, tb, "things", interleaved(2, 5), 5)
	st := outboxStatus(t, tb)
	require.EqualValues(t, 10, st.Pending)
	require.Positive(t, st.OldestPendingAge)
	require.Zero(t, st.Forwarded)
	require.True(t, st.LastForwardedAt.IsZero())

	broker := newMemoryBroker()
	f, _ := start(t, tb, broker, testConfig(), nil)
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })
	st = outboxStatus(t, tb)
	require.Zero(t, st.Pending)
	require.Zero(t, st.OldestPendingAge)
	require.EqualValues(t, 10, st.Forwarded, "forwarded rows stay for the retention period")
	require.WithinDuration(t, time.Now(), st.LastForwardedAt, time.Hour)
}

func TestTopicTheBrokerRefusesIsQuarantinedNotRetriedForever(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	attempts := 0
	broker.refuse = func(topic string) error {
		switch topic {
		case "conflicted":
			return adapters.Permanent(errors.New("queue conflicted:g is a classic queue, quorum wanted"))
		case "flaky":
			if attempts++; attempts < 3 {
				return errors.New("connection reset")
			}
		}
		return nil
	}
	publish(t, tb, "things", []bus.Event{event("a", 1)}, 1)
	publish(t, tb, "conflicted", []bus.Event{event("c", 1), event("c", 2)}, 2)
	publish(t, tb, "flaky", []bus.Event{event("f", 1)}, 1)
	publish(t, tb, "things", []bus.Event{event("a", 2)}, 1)
	f, _ := start(t, tb, broker, testConfig(), nil)
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })

	var got []string
	for _, o := range broker.snapshot() {
		got = append(got, o.Topic+"/"+o.Msg.Metadata.Get(bus.AggregateVersionKey))
	}
	require.Equal(t, []string{"things/1", "flaky/1", "things/2"}, got)
	var quarantined int
	require.NoError(t, tb.db.QueryRow(`SELECT count(*) FROM "`+tb.outbox.Schema+`".millrace_relay_quarantine WHERE reason LIKE '%classic queue%'`).Scan(&quarantined))
	require.Equal(t, 2, quarantined)
	require.GreaterOrEqual(t, attempts, 3, "a transient provisioning failure is retried")
}

// A transaction left open, idle in transaction (a batch job, a leaked
// connection), holds back nothing committed after it: an event committed
// meanwhile is forwarded while it is still open, woken by its NOTIFY alone
// (poll_interval is an hour), and the open transaction's own event once it
// commits.
func TestAnOpenTransactionHoldsBackNothingCommittedAfterIt(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	broker := newMemoryBroker()
	cfg := testConfig()
	cfg.PollInterval = time.Hour
	start(t, tb, broker, cfg, nil)
	publish(t, tb, "things", []bus.Event{event("warm-up", 1)}, 1)
	testkit.Eventually(t, waitLimit, "the relay to forward", func() bool { return len(broker.snapshot()) == 1 })

	older, err := tb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer older.Rollback()
	require.NoError(t, tb.bus.Publish(ctx, older, "things", event("a", 1)))
	unrelated, err := tb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer unrelated.Rollback()
	_, err = unrelated.ExecContext(ctx, `SELECT pg_current_xact_id()`) // takes a transaction id, as any writer does
	require.NoError(t, err)

	publish(t, tb, "things", []bus.Event{event("b", 1)}, 1)
	testkit.Eventually(t, waitLimit, "the event committed after the open transactions", func() bool { return len(broker.snapshot()) == 2 })
	require.Equal(t, "b", broker.snapshot()[1].Msg.Metadata.Get("aggregate-id"))
	require.NoError(t, older.Commit())
	testkit.Eventually(t, waitLimit, "the open transaction's event once it committed", func() bool { return len(broker.snapshot()) == 3 })
	require.Equal(t, "a", broker.snapshot()[2].Msg.Metadata.Get("aggregate-id"))
}

// While the broker has not confirmed a batch, the relay holds no
// transaction open, so no other relay, vacuum or reader waits on it.
func TestTheRelayHoldsNoTransactionWhileTheBrokerConfirms(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	publish(t, tb, "things", interleaved(2, 5), 5)
	app := "relay-" + tb.outbox.Schema[len(tb.outbox.Schema)-8:]
	db, err := sql.Open("pgx", testdb.URL()+"&application_name="+app)
	require.NoError(t, err)
	defer db.Close()
	blocked := &blockingBroker{entered: make(chan struct{}, 1)}
	f, err := forwarder.New(db, blocked, tb.outbox, testConfig(), forwarder.Options{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-blocked.entered
	// Statements of the relay's other loops may be running at any moment
	// (a lease renewal, a backlog count); what must not be is a
	// transaction left open between statements while the broker confirms.
	var sessions, holding int
	require.NoError(t, tb.db.QueryRow(`SELECT count(*), count(*) FILTER (WHERE state LIKE 'idle in transaction%')
		FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&sessions, &holding))
	require.Positive(t, sessions, "the relay's sessions are seen")
	require.Zero(t, holding, "a relay session holds a transaction open while the broker confirms")
}
