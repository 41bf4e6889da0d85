package main

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// A poisoned event, replayed with `millrace dlq replay` after its handler is
// fixed, is processed exactly once by its consumer group; the other group of
// the topic, which processed it the first time, receives every replay too
// (a topic fans out) and acks each without processing it: a replay is for
// the group it was poisoned in.
func TestReplayAfterFixProcessesOnce(t *testing.T) {
	t.Parallel()
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			testReplayAfterFix(t, kind)
		})
	}
}

func testReplayAfterFix(t *testing.T, kind string) {
	ctx := context.Background()
	db := testdb.Open(t)
	schema := testdb.Schema(t, db)
	suffix := schema[len(schema)-8:]
	topic, billing, audit := "orders-"+suffix, "billing-"+suffix, "audit-"+suffix
	brokertest.Cleanup(t, kind, topic, billing, audit)
	path := writeConfig(t, "database:\n  url: "+testdb.URL()+"\n  schema: "+schema+"\nbroker:\n  nats:\n    url: nats://127.0.0.1:4222\n")
	code, _, errOut := cli(t, path, "migrate")
	require.Equal(t, exitOK, code, errOut)
	_, err := db.Exec(`CREATE TABLE "` + schema + `".effects (grp text NOT NULL, event_id text NOT NULL, replay_of text NOT NULL)`)
	require.NoError(t, err)
	effects := func(group, eventID string) int {
		var n int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+schema+`".effects WHERE grp = $1 AND event_id = $2`, group, eventID).Scan(&n))
		return n
	}

	cfg, err := bus.LoadConfig(path)
	require.NoError(t, err)
	brokertest.Apply(t, kind, &cfg)
	cfg.Consumer.HandlerTimeout = 10 * time.Second
	reg := prometheus.NewRegistry()
	b, err := bus.Open(ctx, cfg, db, bus.WithRegistry(reg))
	require.NoError(t, err)
	defer b.Close()

	// billing cannot handle order "bad" until the test fixes it; audit handles everything.
	var broken atomic.Bool
	broken.Store(true)
	effect := func(group string) bus.HandlerFunc {
		return func(ctx context.Context, ev bus.Event) error {
			if group == billing && ev.AggregateID == "bad" && broken.Load() {
				return bus.Permanent(errors.New("billing: no price list for order bad"))
			}
			_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO "`+schema+`".effects VALUES ($1, $2, $3)`,
				group, ev.ID, ev.Metadata[middleware.ReplayOfKey])
			return err
		}
	}
	require.NoError(t, b.Handle(topic, billing, effect(billing)))
	require.NoError(t, b.Handle(topic, audit, effect(audit)))
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	defer func() {
		stop()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(60 * time.Second):
			t.Fatal("Run did not return after its context was cancelled")
		}
	}()

	require.NoError(t, b.PublishInOwnTx(ctx, topic,
		bus.Event{ID: "ev-good-" + suffix, Type: "OrderPlaced", AggregateType: "order", AggregateID: "good", Payload: []byte(`{"order":"good"}`)},
		bus.Event{ID: "ev-bad-" + suffix, Type: "OrderPlaced", AggregateType: "order", AggregateID: "bad", Payload: []byte(`{"order":"bad"}`)}))
	good, bad := "ev-good-"+suffix, "ev-bad-"+suffix

	list := func() []ops.PoisonedMessage {
		var res poisonList
		cliJSON(t, path, &res, "dlq", "list", "--topic", topic)
		return res.Messages
	}
	testkit.Eventually(t, 90*time.Second, "billing's event poisoned, the rest processed", func() bool {
		return len(list()) == 1 && effects(billing, good) == 1 && effects(audit, good) == 1 && effects(audit, bad) == 1
	})
	row := list()[0]
	require.Equal(t, billing, row.ConsumerGroup)
	require.Equal(t, billing, row.Handler)
	require.Equal(t, bad, row.EventID)
	require.Equal(t, "permanent", row.ErrorClass)
	require.Contains(t, row.Reason, "no price list for order bad")
	require.Equal(t, ops.PoisonStatePoisoned, row.State)
	require.Nil(t, row.ProcessedAt, "a poisoned event's inbox row rolled back with its transaction")
	id := strconv.FormatInt(row.ID, 10)
	show := func() showResult {
		var res showResult
		cliJSON(t, path, &res, "dlq", "show", id)
		return res
	}
	auditNotTargeted := func() float64 { return messagesTotal(t, reg, audit, middleware.OutcomeNotTargeted) }
	billingDuplicates := func() float64 { return messagesTotal(t, reg, billing, middleware.OutcomeDuplicate) }

	// A replay before the fix is poisoned again, in the same row.
	var res ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry]
	cliJSON(t, path, &res, "dlq", "replay", id)
	require.Len(t, res.Replayed, 1)
	require.NotEmpty(t, res.Replayed[0].MessageID)
	require.NotEqual(t, row.MessageID, res.Replayed[0].MessageID, "a replay has a message id of its own")
	testkit.Eventually(t, 90*time.Second, "the replay poisoned again and acked by the other group without processing", func() bool {
		s := show()
		return s.TimesPoisoned == 2 && s.ReplayedAt == nil && auditNotTargeted() >= 1
	})
	require.Len(t, list(), 1, "poisoning a replay again updates the original row")
	require.Equal(t, row.MessageID, show().MessageID)

	// Fixed: a dry run changes nothing, the replay is processed exactly once.
	broken.Store(false)
	var dry dryReplay
	cliJSON(t, path, &dry, "dlq", "replay", "--dry-run", id)
	require.True(t, dry.DryRun)
	require.Equal(t, []ops.ReplayedEntry{{ID: row.ID, ConsumerGroup: billing, Handler: billing, Topic: topic, EventID: bad, EventType: "OrderPlaced",
		TargetGroups: []string{billing}}}, dry.WouldReplay)
	require.Equal(t, 1, dry.WouldWrite)
	require.Equal(t, 1, show().ReplayCount, "a dry run records no replay")
	require.Nil(t, show().ReplayedAt)

	res = ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry]{}
	cliJSON(t, path, &res, "dlq", "replay", "--topic", topic, "--not-replayed")
	require.Len(t, res.Replayed, 1)
	testkit.Eventually(t, 90*time.Second, "the replay processed by billing", func() bool { return effects(billing, bad) == 1 })
	var replayOf string
	require.NoError(t, db.QueryRow(`SELECT replay_of FROM "`+schema+`".effects WHERE grp = $1 AND event_id = $2`, billing, bad).Scan(&replayOf))
	require.Equal(t, row.MessageID, replayOf, "the handler sees which message the replay re-sends")
	testkit.Eventually(t, 90*time.Second, "the poison row shows the event processed", func() bool { return show().State == ops.PoisonStateProcessed })
	s := show()
	require.NotNil(t, s.ReplayedAt)
	require.NotNil(t, s.ProcessedAt)
	require.Equal(t, 2, s.ReplayCount)
	require.Equal(t, 2, s.TimesPoisoned)

	// Replaying it again is skipped: billing's inbox has the event.
	res = ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry]{}
	cliJSON(t, path, &res, "dlq", "replay", id)
	require.Empty(t, res.Replayed)
	require.Len(t, res.Skipped, 1)
	require.Equal(t, ops.SkipAlreadyProcessed, res.Skipped[0].Reason)
	require.Zero(t, res.Messages)
	code, out, errOut := cli(t, path, "dlq", "replay", id)
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "skipped "+id+" (group "+billing)

	// Forced, it is delivered again and billing's inbox acks it as a duplicate.
	before := billingDuplicates()
	res = ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry]{}
	cliJSON(t, path, &res, "dlq", "replay", "--force", id)
	require.Len(t, res.Replayed, 1)
	testkit.Eventually(t, 90*time.Second, "billing acked the forced replay as a duplicate", func() bool { return billingDuplicates() > before })
	testkit.Eventually(t, 90*time.Second, "audit acked all three replays without processing", func() bool { return auditNotTargeted() >= 3 })

	require.Equal(t, 1, effects(billing, bad), "exactly one effect of the replayed event")
	require.Equal(t, 1, effects(audit, bad), "the other group kept one effect")
	require.Equal(t, 1, effects(billing, good))
	require.Equal(t, 1, effects(audit, good))
	s = show()
	require.Equal(t, 3, s.ReplayCount)
	require.Len(t, s.Replays, 3)
	require.Equal(t, []int{1, 2, 2}, []int{s.Replays[0].TimesPoisoned, s.Replays[1].TimesPoisoned, s.Replays[2].TimesPoisoned})
	require.NotEmpty(t, s.Replays[0].ReplayedBy)
}

var gatherMu sync.Mutex

// messagesTotal reads millrace_consumer_messages_total for handler and outcome.
func messagesTotal(t *testing.T, reg *prometheus.Registry, handler, outcome string) float64 {
	t.Helper()
	gatherMu.Lock()
	defer gatherMu.Unlock()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != middleware.MetricMessages {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["handler"] == handler && labels["outcome"] == outcome {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}
