package forwarder_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/ops"
)

// percentile is the p-th percentile (0-100) of sorted ds.
func percentile(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	return ds[min(len(ds)-1, len(ds)*p/100)]
}

func scheduledEvent(prefix string, i int) bus.Event {
	return bus.Event{ID: fmt.Sprintf("%s-%d-%s", prefix, i, watermill.NewShortUUID()), Type: "Reminded",
		AggregateType: "order", AggregateID: fmt.Sprintf("order-%d", i%50), Payload: []byte(`{}`)}
}

// 1,000 events scheduled over 10 s, with 1,000 immediate ones published
// while they wait and 20 scheduled ones cancelled: each scheduled event is
// published no earlier than its due time and within 1 s after it (after
// its commit, for the few a loaded machine commits after they are due), the
// immediate ones are published within 1 s of their commit (the scheduled
// ones never hold them back), and a cancelled one is never published.
func TestScheduledEventsArePublishedWhenDue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEndToEnd(t, bus.KindNATS, "sched")
	got := brokertest.RecordArrivals(t, e.broker, e.topic, e.topic+"-when")
	f, err := forwarder.New(e.db, e.broker, forwarder.Outbox{Schema: e.cfg.Database.Schema, Topic: e.cfg.Outbox.Topic}, e.cfg.Relay, forwarder.Options{})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- f.Run(runCtx) }()
	t.Cleanup(func() { stop(); <-relayDone })

	const scheduled, immediate, cancelled, window = 1000, 1000, 20, 10 * time.Second
	// Due times are whole microseconds, PostgreSQL's precision, so that
	// "no earlier than due" compares like with like.
	start := time.Now().Truncate(time.Microsecond)
	due, from := scheduleSpread(t, e, start, scheduled, window)
	cancel := scheduleAndCancel(t, e, cancelled)
	committed := publishWhileWaiting(t, e, start, immediate, window)

	testkit.Eventually(t, waitLimit, "every event published", func() bool { return got.Distinct() >= scheduled+immediate })
	entered := outboxEntries(t, e)
	move := checkScheduledArrivals(t, got, due, from, entered, committed)
	// Every cancelled event was due seconds ago.
	for _, id := range cancel {
		_, ok := got.At(id)
		require.False(t, ok, "cancelled event %s was published", id)
	}
	require.Equal(t, scheduled+immediate, got.Distinct(), "only the events not cancelled are published")
	behind := 0 // committed after their due time
	for id, at := range due {
		if from[id] != at {
			behind++
		}
	}
	t.Logf("%d of %d scheduled events were committed after their due time", behind, scheduled)
	// The scheduler's part is bounded by 1 s. From the outbox on, a
	// scheduled event is relayed and consumed like any other: that part is
	// logged, not bounded here, since on a machine busy with other test
	// packages the consumer's backlog alone has taken tens of seconds.
	require.Less(t, move[len(move)-1], time.Second, "a scheduled event entered the outbox more than 1 s after its due time")
	// Immediate events never wait for scheduled ones: each is in the outbox
	// from its own commit on, whatever is scheduled.
	for id, at := range committed {
		in, ok := entered[id]
		require.True(t, ok, "immediate event %s is not in the outbox", id)
		require.False(t, in.After(at), "immediate event %s entered the outbox %s after its commit", id, in.Sub(at))
	}
}

// scheduleSpread schedules n events in ten transactions, each spread over
// window from start on, written in an order that is not the due order. It
// returns each event's due time, and when it was due or, if later,
// committed: what lateness is measured from.
func scheduleSpread(t *testing.T, e endToEnd, start time.Time, n int, window time.Duration) (due, from map[string]time.Time) {
	ctx := context.Background()
	due, from = map[string]time.Time{}, map[string]time.Time{}
	rng := rand.New(rand.NewPCG(uint64(start.UnixNano()), 17))
	for txn := range 10 {
		tx, err := e.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		var written []string
		for i := range n / 10 {
			at := start.Add(time.Second + time.Duration(rng.Int64N(int64(window-time.Second)))).Truncate(time.Microsecond)
			ids, err := e.bus.Schedule(ctx, tx, e.topic, bus.DueAt(at), scheduledEvent("due", txn*100+i))
			require.NoError(t, err)
			due[ids[0]] = at
			written = append(written, ids[0])
		}
		require.NoError(t, tx.Commit())
		commit := time.Now()
		for _, id := range written {
			from[id] = maxTime(due[id], commit)
		}
	}
	return due, from
}

// scheduleAndCancel schedules n events due in 2 s and more, cancels them
// in another transaction, and returns their ids.
func scheduleAndCancel(t *testing.T, e endToEnd, n int) []string {
	ctx := context.Background()
	var cancel []string
	tx, err := e.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	for i := range n {
		ids, err := e.bus.Schedule(ctx, tx, e.topic, bus.DueIn(2*time.Second+time.Duration(i)*100*time.Millisecond), scheduledEvent("cancel", i))
		require.NoError(t, err)
		cancel = append(cancel, ids...)
	}
	require.NoError(t, tx.Commit())
	tx, err = e.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	for _, id := range cancel {
		require.NoError(t, e.bus.CancelScheduled(ctx, tx, id))
	}
	require.NoError(t, tx.Commit())
	require.ErrorIs(t, e.bus.CancelScheduled(ctx, mustBegin(t, e), cancel[0]), bus.ErrNotScheduled, "a cancelled event cannot be cancelled again")
	return cancel
}

// publishWhileWaiting publishes n immediate events, a tenth every tenth of
// window from start on, while the scheduled ones wait, and returns when
// each was committed.
func publishWhileWaiting(t *testing.T, e endToEnd, start time.Time, n int, window time.Duration) map[string]time.Time {
	ctx := context.Background()
	committed := map[string]time.Time{}
	for round := range n / 100 {
		tx, err := e.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		var events []bus.Event
		for i := range 100 {
			events = append(events, scheduledEvent("now", round*100+i))
		}
		require.NoError(t, e.bus.Publish(ctx, tx, e.topic, events...))
		require.NoError(t, tx.Commit())
		at := time.Now()
		for _, ev := range events {
			committed[ev.ID] = at
		}
		time.Sleep(time.Until(start.Add(time.Duration(round+1) * window / 10)))
	}
	return committed
}

// outboxEntries returns when each event entered the outbox: its commit,
// or for a scheduled one the scheduler's move.
func outboxEntries(t *testing.T, e endToEnd) map[string]time.Time {
	entered := map[string]time.Time{}
	rows, err := e.db.QueryContext(context.Background(), `SELECT uuid, EXTRACT(EPOCH FROM created_at AT TIME ZONE current_setting('TimeZone'))::float8 FROM "`+
		e.cfg.Database.Schema+`"."watermill_`+e.cfg.Outbox.Topic+`"`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		var epoch float64
		require.NoError(t, rows.Scan(&id, &epoch))
		entered[id] = time.Unix(0, int64(epoch*1e9))
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())
	return entered
}

// checkScheduledArrivals checks that every scheduled event arrived, no
// earlier than due, and every immediate one arrived, and logs how long
// each part took. It returns, sorted, how long each scheduled event took
// from due (or commit) to the outbox.
func checkScheduledArrivals(t *testing.T, got *brokertest.Arrivals, due, from, entered, committed map[string]time.Time) (move []time.Duration) {
	// late is from due (or commit) to the consumer, relayed from the outbox
	// to the consumer, lag from commit to the consumer of an immediate event.
	var late, relayed, lag []time.Duration
	for id, at := range due {
		arrived, ok := got.At(id)
		require.True(t, ok, "scheduled event %s never published", id)
		require.False(t, arrived.Before(at), "scheduled event %s published %s before its due time", id, at.Sub(arrived))
		in, ok := entered[id]
		require.True(t, ok, "scheduled event %s is not in the outbox", id)
		late = append(late, arrived.Sub(from[id]))
		move = append(move, in.Sub(from[id]))
		relayed = append(relayed, arrived.Sub(in))
	}
	for id, at := range committed {
		arrived, ok := got.At(id)
		require.True(t, ok, "immediate event %s never published", id)
		lag = append(lag, arrived.Sub(at))
	}
	for _, ds := range [][]time.Duration{late, move, relayed, lag} {
		slices.Sort(ds)
	}
	t.Logf("scheduled: lateness p50 %s, p99 %s, max %s (due to outbox p99 %s, max %s; outbox to consumer p99 %s, max %s); "+
		"immediate: commit to consumer p50 %s, p99 %s, max %s",
		percentile(late, 50), percentile(late, 99), late[len(late)-1], percentile(move, 99), move[len(move)-1],
		percentile(relayed, 99), relayed[len(relayed)-1], percentile(lag, 50), percentile(lag, 99), lag[len(lag)-1])
	return move
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func mustBegin(t *testing.T, e endToEnd) *sql.Tx {
	tx, err := e.db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// Relays killed with SIGKILL again and again while 2,000 scheduled events
// fall due, at random moments and right after a move into the outbox
// committed (before the relay published what it moved): after a clean relay
// runs, every event is published and none is left scheduled. (The move is
// one transaction: a kill in the middle of it leaves the events scheduled.)
func TestScheduledEventsSurviveRelayKills(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEndToEnd(t, bus.KindNATS, "schedkill")
	const events, window = 2000, 4 * time.Second
	start := time.Now()
	var ids []string
	for txn := range 20 {
		tx, err := e.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		for i := range events / 20 {
			n := txn*events/20 + i
			at := start.Add(time.Second + window*time.Duration(n)/events)
			got, err := e.bus.Schedule(ctx, tx, e.topic, bus.DueAt(at), scheduledEvent("kill", n))
			require.NoError(t, err)
			ids = append(ids, got...)
		}
		require.NoError(t, tx.Commit())
	}
	rng := rand.New(rand.NewPCG(uint64(start.UnixNano()), 23))
	kills := 0
	for time.Since(start) < window+1500*time.Millisecond {
		// Every other relay kills itself right after a move committed,
		// before it published what it moved; the others die at a random
		// moment, in a move or between moves.
		kill := ""
		if kills%2 == 0 {
			kill = fmt.Sprintf("after-move:%d", 1+rng.IntN(3))
		}
		proc := startRelayProcess(t, e.cfg, kill)
		select {
		case <-proc.Done():
		case <-time.After(time.Duration(150+rng.IntN(500)) * time.Millisecond):
			proc.Kill()
			<-proc.Done()
		}
		require.True(t, proc.KilledBySIGKILL(), "relay %d: %v", kills, proc.Err())
		kills++
	}
	moved := e.got.distinct()
	startRelayProcess(t, e.cfg, "") // a clean relay, killed when the test ends
	testkit.Eventually(t, waitLimit, "every scheduled event published", func() bool { return e.got.distinct() >= events })

	oc, err := ops.New(ctx, e.db, e.cfg)
	require.NoError(t, err)
	left, err := oc.ListScheduled(ctx, 10)
	require.NoError(t, err)
	require.Zero(t, left.Total, "events left scheduled: %v", left.Events)
	e.got.mu.Lock()
	defer e.got.mu.Unlock()
	for _, id := range ids {
		require.Positive(t, e.got.count[id], "scheduled event %s was lost", id)
	}
	require.Len(t, e.got.count, events)
	t.Logf("%d kills; %d of %d events published before the clean relay, %d deliveries (%d duplicates)",
		kills, moved, events, e.got.total, e.got.total-events)
}

// With both fallback polls an hour long, only the next due time and the
// NOTIFY of a newly scheduled event can wake the scheduler: an event
// scheduled in 300 ms while the scheduler sleeps until one due in an hour
// is still published on time, and the later one is not.
func TestSchedulerWakesForASoonerEventWithoutPolling(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	cfg := testConfig()
	cfg.PollInterval = time.Hour
	cfg.SchedulePollInterval = time.Hour
	start(t, tb, broker, cfg, nil)
	ctx := context.Background()
	schedule := func(when bus.When, ev bus.Event) {
		tx, err := tb.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = tb.bus.Schedule(ctx, tx, "things", when, ev)
		require.NoError(t, err)
		require.NoError(t, tx.Commit())
	}
	schedule(bus.DueIn(time.Hour), event("later", 1))
	time.Sleep(200 * time.Millisecond) // the scheduler goes to sleep until the later one is due
	scheduled := time.Now()
	schedule(bus.DueIn(300*time.Millisecond), event("sooner", 1))
	testkit.Eventually(t, waitLimit, "the sooner event published", func() bool { return len(broker.snapshot()) == 1 })
	require.GreaterOrEqual(t, time.Since(scheduled), 300*time.Millisecond, "published before it was due")
	got := broker.snapshot()
	require.Equal(t, "sooner", got[0].Msg.Metadata.Get(bus.AggregateIDKey))
	time.Sleep(100 * time.Millisecond)
	require.Len(t, broker.snapshot(), 1, "the event due in an hour waits")
}
