package ops_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// opsWorld is a service on NATS with one handler that poisons the events a
// test marks bad, and the operations API over its tables.
type opsWorld struct {
	db    *sql.DB
	cfg   bus.Config
	bus   *bus.Bus
	ops   *ops.Client
	topic string
	group string

	mu      sync.Mutex
	bad     map[string]bool // aggregate ids whose events the handler refuses
	handled map[string]int  // event id -> effects
	order   []string        // event ids in the order they took effect
}

// newOpsWorld starts the world; tune changes its config first.
func newOpsWorld(t *testing.T, tune ...func(*bus.Config)) *opsWorld {
	ctx := context.Background()
	svc := brokertest.NewService(t, bus.KindNATS, append([]func(*bus.Config){func(cfg *bus.Config) { cfg.Relay.PollInterval = 100 * time.Millisecond }}, tune...)...)
	w := &opsWorld{db: svc.DB, cfg: svc.Config, topic: "ops-_" + testkit.Suffix(), bad: map[string]bool{}, handled: map[string]int{}}
	w.group = w.topic + "-billing"
	brokertest.Cleanup(t, bus.KindNATS, w.topic, w.group)
	b := svc.Open(t)
	w.bus = b
	require.NoError(t, b.Handle(w.topic, w.group, func(_ context.Context, ev bus.Event) error {
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.bad[ev.AggregateID] {
			return bus.Permanent(fmt.Errorf("payment gateway refused %s", ev.AggregateID))
		}
		w.handled[ev.ID]++
		w.order = append(w.order, ev.ID)
		return nil
	}))
	running := testkit.Start(t, b.Run)
	t.Cleanup(func() { require.NoError(t, running.Stop(t, time.Minute)) })
	var err error
	w.ops, err = ops.New(ctx, svc.DB, svc.Config)
	require.NoError(t, err)
	return w
}

func (w *opsWorld) publish(t *testing.T, aggregate string) string {
	id := watermill.NewUUID()
	require.NoError(t, w.bus.PublishInOwnTx(context.Background(), w.topic, bus.Event{
		ID: id, Type: "OrderPlaced", AggregateType: "order", AggregateID: aggregate, Payload: []byte(`{"total":1}`),
	}))
	return id
}

func (w *opsWorld) effects(id string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.handled[id]
}

// The DLQ through the operations API: list with filters, show, replay (dry
// run first, then for real, then again: skipped as processed), purge.
func TestOpsDLQListShowReplayPurge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newOpsWorld(t)
	w.bad["o-bad-1"], w.bad["o-bad-2"] = true, true
	bad1, bad2 := w.publish(t, "o-bad-1"), w.publish(t, "o-bad-2")
	good := w.publish(t, "o-good")
	testkit.Eventually(t, time.Minute, "two messages poisoned", func() bool {
		l, err := w.ops.DLQ().List(ctx, ops.Filter{}, 0)
		return err == nil && len(l.Rows) == 2
	})
	testkit.Eventually(t, time.Minute, "the good event handled", func() bool { return w.effects(good) == 1 })

	m := checkDLQListAndShow(t, w, bad2)
	checkSelectionErrors(t, w, m.ID)

	// The relay acks a batch after the broker confirmed it, which can be
	// after the consumer handled it: wait for the ack before counting.
	testkit.Eventually(t, time.Minute, "the relay acked the three events", func() bool {
		st, err := w.ops.OutboxStatus(ctx, "")
		return err == nil && st.Pending == 0
	})
	dry, err := w.ops.DLQ().Replay(ctx, ops.Selection{All: true}, ops.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Len(t, dry.Replayed, 2)
	require.Equal(t, 2, dry.Messages)
	st, err := w.ops.OutboxStatus(ctx, "")
	require.NoError(t, err)
	require.Zero(t, st.Pending, "a dry run writes nothing")

	w.mu.Lock()
	w.bad = map[string]bool{} // the gateway is fixed
	w.mu.Unlock()
	res, err := w.ops.DLQ().Replay(ctx, ops.Selection{Filter: ops.Filter{Handler: w.group}}, ops.ReplayOptions{By: "tester@host"})
	require.NoError(t, err)
	require.Len(t, res.Replayed, 2)
	for _, r := range res.Replayed {
		require.NotEmpty(t, r.MessageID, "a replay has a message id of its own")
	}
	testkit.Eventually(t, time.Minute, "both replays handled once", func() bool { return w.effects(bad1) == 1 && w.effects(bad2) == 1 })
	d, err := w.ops.DLQ().Get(ctx, m.ID)
	require.NoError(t, err)
	require.Len(t, d.Replays, 1)
	require.Equal(t, "tester@host", d.Replays[0].ReplayedBy)
	testkit.Eventually(t, time.Minute, "the inbox records the replayed event", func() bool {
		d, err := w.ops.DLQ().Get(ctx, m.ID)
		return err == nil && d.State == ops.PoisonStateProcessed
	})

	again, err := w.ops.DLQ().Replay(ctx, ops.Selection{IDs: []int64{m.ID}}, ops.ReplayOptions{})
	require.NoError(t, err)
	require.Empty(t, again.Replayed)
	require.Len(t, again.Skipped, 1)
	require.Equal(t, ops.SkipAlreadyProcessed, again.Skipped[0].Reason)

	checkDLQPurge(t, w)
	require.Equal(t, 1, w.effects(bad1), "one effect per event, replays included")
}

// The relay quarantine through the operations API: rows set aside because
// the stream conflicted with the config are replayed once the stream is
// fixed and arrive with their event ids; a row the broker still refuses is
// skipped; purge deletes.
func TestOpsQuarantineListShowReplayPurge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newOpsWorld(t)
	conflicted := "ops-conflict-_" + testkit.Suffix()
	brokertest.Cleanup(t, bus.KindNATS, conflicted)
	js := brokertest.NATSJetStream(t, w.cfg.Broker.NATS.URL)
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: nats.StreamName(conflicted), Subjects: []string{conflicted}, MaxAge: time.Hour})
	require.NoError(t, err)

	ids := []string{watermill.NewUUID(), watermill.NewUUID()}
	for _, id := range ids {
		require.NoError(t, w.bus.PublishInOwnTx(ctx, conflicted, bus.Event{ID: id, Type: "T", AggregateType: "a", AggregateID: "1", Payload: []byte(`{}`)}))
	}
	reserved := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	reserved.Metadata.Set("Nats-Rollup", "all") // written by plain Watermill: nothing checked it
	brokertest.WriteOutboxWithWatermill(t, w.db, w.cfg, w.topic, reserved)
	testkit.Eventually(t, time.Minute, "three rows quarantined", func() bool {
		st, err := w.ops.OutboxStatus(ctx, "")
		return err == nil && st.Quarantined == 3 && st.Pending == 0
	})

	list, err := w.ops.Quarantine().List(ctx, ops.Filter{Topic: conflicted}, 0)
	require.NoError(t, err)
	require.Len(t, list.Rows, 2)
	require.Contains(t, list.Rows[0].Reason, "max_age")
	d, err := w.ops.Quarantine().Get(ctx, list.Rows[0].ID)
	require.NoError(t, err)
	require.Empty(t, d.EnvelopeError)
	require.Contains(t, ids, d.Metadata[bus.EventIDKey])

	// Not fixed yet: the broker still refuses the reserved header.
	all, err := w.ops.Quarantine().Replay(ctx, ops.Selection{All: true}, ops.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Len(t, all.Replayed, 2)
	require.Len(t, all.Skipped, 1)
	require.Equal(t, ops.SkipRefusedByBroker, all.Skipped[0].Skip)
	require.Contains(t, all.Skipped[0].Detail, "Nats-Rollup")

	// Fix the stream, then replay the conflicted rows.
	require.NoError(t, js.DeleteStream(ctx, nats.StreamName(conflicted)))
	got := subscribe(t, w, conflicted)
	res, err := w.ops.Quarantine().Replay(ctx, ops.Selection{Filter: ops.Filter{Topic: conflicted}}, ops.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, res.Replayed, 2)
	for _, id := range ids {
		select {
		case gotID := <-got:
			require.Contains(t, ids, gotID, "the replayed event keeps its id")
		case <-time.After(time.Minute):
			t.Fatalf("replayed event %s never arrived", id)
		}
	}
	replayed := true
	list, err = w.ops.Quarantine().List(ctx, ops.Filter{Replayed: &replayed}, 0)
	require.NoError(t, err)
	require.Len(t, list.Rows, 2)
	require.Equal(t, 1, list.Rows[0].TimesReplayed)

	_, err = w.ops.Quarantine().Purge(ctx, ops.Selection{IDs: []int64{999999}}, false)
	require.ErrorIs(t, err, ops.ErrNotFound)
	purged, err := w.ops.Quarantine().Purge(ctx, ops.Selection{Filter: ops.Filter{Reason: "nats-rollup"}}, false)
	require.NoError(t, err)
	require.Len(t, purged.Purged, 1)
	st, err := w.ops.OutboxStatus(ctx, "")
	require.NoError(t, err)
	require.EqualValues(t, 2, st.Quarantined)
}

// Pruning the inbox through the operations API: a dry run counts, a prune
// deletes only old rows of the group asked for, and a window shorter than
// the retention is warned about.
func TestOpsPruneInbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newOpsWorld(t)
	var ids []string
	for i := range 3 {
		ids = append(ids, w.publish(t, fmt.Sprintf("o-%d", i)))
	}
	testkit.Eventually(t, time.Minute, "three events handled", func() bool {
		rows, err := w.ops.InboxRows(ctx)
		return err == nil && rows[w.group] == 3
	})
	_, err := w.db.Exec(`UPDATE "`+w.cfg.Database.Schema+`".millrace_inbox SET processed_at = now() - interval '40 days' WHERE event_id = ANY($1)`, ids[:2])
	require.NoError(t, err)

	res, err := w.ops.PruneInbox(ctx, ops.InboxPrune{OlderThan: 30 * 24 * time.Hour, DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Deleted)
	require.Empty(t, res.Warnings)
	res, err = w.ops.PruneInbox(ctx, ops.InboxPrune{OlderThan: 30 * 24 * time.Hour, Group: "another-group"})
	require.NoError(t, err)
	require.Zero(t, res.Deleted)
	res, err = w.ops.PruneInbox(ctx, ops.InboxPrune{OlderThan: 30 * 24 * time.Hour, Group: w.group, Batch: 1})
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Deleted)
	rows, err := w.ops.InboxRows(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, rows[w.group])

	res, err = w.ops.PruneInbox(ctx, ops.InboxPrune{OlderThan: time.Hour, DryRun: true})
	require.NoError(t, err)
	require.Len(t, res.Warnings, 1)
	require.Contains(t, res.Warnings[0], "shorter than consumer.inbox.retention")
	_, err = w.ops.PruneInbox(ctx, ops.InboxPrune{})
	require.ErrorContains(t, err, "OlderThan must be positive")
}

// New names a database that is not migrated.
func TestOpsRefusesAnUnmigratedDatabase(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	_, err := ops.New(context.Background(), db, cfg)
	require.ErrorContains(t, err, "does not exist: run `millrace migrate`")
}

// subscribe returns the event ids that reach topic, for a group of the test's.
func subscribe(t *testing.T, w *opsWorld, topic string) <-chan string {
	t.Helper()
	ch := brokertest.Tap(t, w.cfg, topic, "tap")
	out := make(chan string, 16)
	go func() {
		for m := range ch {
			out <- m.Metadata.Get(bus.EventIDKey)
			m.Ack()
		}
	}()
	return out
}

// checkDLQListAndShow lists the two poisoned messages with filters and
// shows the one of event bad2, which it returns.
func checkDLQListAndShow(t *testing.T, w *opsWorld, bad2 string) ops.PoisonedMessage {
	t.Helper()
	ctx := context.Background()
	list, err := w.ops.DLQ().List(ctx, ops.Filter{Reason: "O-BAD-2"}, 0)
	require.NoError(t, err)
	require.Len(t, list.Rows, 1, "the reason filter is case-insensitive")
	m := list.Rows[0]
	require.Equal(t, bad2, m.EventID)
	require.Equal(t, "o-bad-2", m.AggregateID)
	require.Equal(t, ops.PoisonStatePoisoned, m.State)
	require.Equal(t, middleware.ClassPermanent, m.ErrorClass)
	list, err = w.ops.DLQ().List(ctx, ops.Filter{Group: w.group, Since: ops.Ago(time.Hour), Until: ops.Ago(-time.Hour)}, 1)
	require.NoError(t, err)
	require.Len(t, list.Rows, 1)
	require.True(t, list.Truncated, "two match, the limit is one")
	list, err = w.ops.DLQ().List(ctx, ops.Filter{Topic: "other"}, 0)
	require.NoError(t, err)
	require.Empty(t, list.Rows)

	d, err := w.ops.DLQ().Get(ctx, m.ID)
	require.NoError(t, err)
	require.JSONEq(t, `{"total":1}`, string(d.Payload))
	require.Equal(t, "o-bad-2", d.Metadata[bus.AggregateIDKey])
	require.Empty(t, d.Replays)
	_, err = w.ops.DLQ().Get(ctx, 999999)
	require.ErrorIs(t, err, ops.ErrNotFound)
	return m
}

// checkSelectionErrors checks that replays and purges refuse selections
// that say nothing, or several things, or name a missing id (id exists),
// and that the relay quarantine refuses the DLQ's filter fields.
func checkSelectionErrors(t *testing.T, w *opsWorld, id int64) {
	t.Helper()
	ctx := context.Background()
	// Selections must say what they act on, and ids must exist.
	_, err := w.ops.DLQ().Replay(ctx, ops.Selection{}, ops.ReplayOptions{})
	require.ErrorIs(t, err, ops.ErrInvalidSelection)
	_, err = w.ops.DLQ().Replay(ctx, ops.Selection{IDs: []int64{id}, All: true}, ops.ReplayOptions{})
	require.ErrorIs(t, err, ops.ErrInvalidSelection)
	_, err = w.ops.DLQ().Purge(ctx, ops.Selection{IDs: []int64{id, 999999}}, false)
	var nf *ops.NotFoundError
	require.ErrorAs(t, err, &nf)
	require.Equal(t, []int64{999999}, nf.IDs, "nothing was purged: the selection named a missing id")
	_, err = w.ops.Quarantine().List(ctx, ops.Filter{Handler: w.group}, 0)
	require.ErrorIs(t, err, ops.ErrInvalidFilter, "the relay quarantine has no handlers")
	_, err = w.ops.Quarantine().Purge(ctx, ops.Selection{Filter: ops.Filter{Fingerprint: "0123456789ab"}}, true)
	require.ErrorIs(t, err, ops.ErrInvalidFilter, "nor failure groups")
}

// checkDLQPurge purges the DLQ's two messages, first as a dry run.
func checkDLQPurge(t *testing.T, w *opsWorld) {
	t.Helper()
	ctx := context.Background()
	purged, err := w.ops.DLQ().Purge(ctx, ops.Selection{All: true}, true)
	require.NoError(t, err)
	require.Len(t, purged.Purged, 2)
	list, err := w.ops.DLQ().List(ctx, ops.Filter{}, 0)
	require.NoError(t, err)
	require.Len(t, list.Rows, 2, "a dry run purges nothing")
	purged, err = w.ops.DLQ().Purge(ctx, ops.Selection{All: true}, false)
	require.NoError(t, err)
	require.Len(t, purged.Purged, 2)
	list, err = w.ops.DLQ().List(ctx, ops.Filter{}, 0)
	require.NoError(t, err)
	require.Empty(t, list.Rows)
}
