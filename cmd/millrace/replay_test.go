package main

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
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
	brokertest.EachKind(t, testReplayAfterFix)
}

// replayRig is one broker's service whose billing group cannot handle
// order "bad" until the test fixes it; audit handles everything. Both
// write an effect row per event they process.
type replayRig struct {
	t                     *testing.T
	db                    *sql.DB
	schema, path          string // path: the CLI's config file
	reg                   *prometheus.Registry
	topic, billing, audit string
	good, bad             string // event ids
	broken                atomic.Bool
}

func testReplayAfterFix(t *testing.T, kind string) {
	r := newReplayRig(t, kind)
	row := r.waitPoisoned()
	id := strconv.FormatInt(row.ID, 10)
	r.replayBeforeFix(row, id)
	r.broken.Store(false)
	r.dryRun(row, id)
	r.replayFixed(row)
	r.replayAgainIsSkipped(id)
	r.forcedReplayIsADuplicate(id)

	require.Equal(t, 1, r.effects(r.billing, r.bad), "exactly one effect of the replayed event")
	require.Equal(t, 1, r.effects(r.audit, r.bad), "the other group kept one effect")
	require.Equal(t, 1, r.effects(r.billing, r.good))
	require.Equal(t, 1, r.effects(r.audit, r.good))
	s := r.show(id)
	require.Equal(t, 3, s.ReplayCount)
	require.Len(t, s.Replays, 3)
	require.Equal(t, []int{1, 2, 2}, []int{s.Replays[0].TimesPoisoned, s.Replays[1].TimesPoisoned, s.Replays[2].TimesPoisoned})
	require.NotEmpty(t, s.Replays[0].ReplayedBy)
}

// newReplayRig migrates through the CLI, opens the service on kind, runs
// billing and audit, and publishes a good and a bad order.
func newReplayRig(t *testing.T, kind string) *replayRig {
	ctx := context.Background()
	r := &replayRig{t: t, db: testdb.Open(t), reg: prometheus.NewRegistry()}
	r.schema = testdb.Schema(t, r.db)
	suffix := r.schema[len(r.schema)-8:]
	r.topic, r.billing, r.audit = "orders-"+suffix, "billing-"+suffix, "audit-"+suffix
	r.good, r.bad = "ev-good-"+suffix, "ev-bad-"+suffix
	brokertest.Cleanup(t, kind, r.topic, r.billing, r.audit)
	r.path = migrateConfig(t, testdb.URL(), r.schema, "")
	_, err := r.db.Exec(`CREATE TABLE "` + r.schema + `".effects (grp text NOT NULL, event_id text NOT NULL, replay_of text NOT NULL)`)
	require.NoError(t, err)

	cfg, err := bus.LoadConfig(r.path)
	require.NoError(t, err)
	brokertest.Apply(t, kind, &cfg)
	cfg.Consumer.HandlerTimeout = 10 * time.Second
	b, err := bus.Open(ctx, cfg, r.db, bus.WithRegistry(r.reg))
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	r.broken.Store(true)
	require.NoError(t, b.Handle(r.topic, r.billing, r.effect(r.billing)))
	require.NoError(t, b.Handle(r.topic, r.audit, r.effect(r.audit)))
	running := testkit.Start(t, b.Run)
	t.Cleanup(func() { require.NoError(t, running.Stop(t, 60*time.Second)) })
	require.NoError(t, b.PublishInOwnTx(ctx, r.topic,
		bus.Event{ID: r.good, Type: "OrderPlaced", AggregateType: "order", AggregateID: "good", Payload: []byte(`{"order":"good"}`)},
		bus.Event{ID: r.bad, Type: "OrderPlaced", AggregateType: "order", AggregateID: "bad", Payload: []byte(`{"order":"bad"}`)}))
	return r
}

// effect is group's handler: it writes an effect row, except billing's
// for order "bad" while broken.
func (r *replayRig) effect(group string) bus.HandlerFunc {
	return func(ctx context.Context, ev bus.Event) error {
		if group == r.billing && ev.AggregateID == "bad" && r.broken.Load() {
			return bus.Permanent(errors.New("billing: no price list for order bad"))
		}
		_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO "`+r.schema+`".effects VALUES ($1, $2, $3)`,
			group, ev.ID, ev.Metadata[middleware.ReplayOfKey])
		return err
	}
}

// effects is how many effects group has of eventID.
func (r *replayRig) effects(group, eventID string) int {
	var n int
	require.NoError(r.t, r.db.QueryRow(`SELECT count(*) FROM "`+r.schema+`".effects WHERE grp = $1 AND event_id = $2`, group, eventID).Scan(&n))
	return n
}

// list is `dlq list` of the topic.
func (r *replayRig) list() []ops.PoisonedMessage {
	var res poisonList
	cliJSON(r.t, r.path, &res, "dlq", "list", "--topic", r.topic)
	return res.Messages
}

// show is `dlq show id`.
func (r *replayRig) show(id string) showResult {
	var res showResult
	cliJSON(r.t, r.path, &res, "dlq", "show", id)
	return res
}

// replay is `dlq replay args...`.
func (r *replayRig) replay(args ...string) ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry] {
	var res ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry]
	cliJSON(r.t, r.path, &res, append([]string{"dlq", "replay"}, args...)...)
	return res
}

// outcomes reads millrace_consumer_messages_total of handler and outcome.
func (r *replayRig) outcomes(handler, outcome string) float64 {
	return testkit.Metric(r.t, r.reg, middleware.MetricMessages, map[string]string{"handler": handler, "outcome": outcome})
}

// waitPoisoned waits until billing poisoned "bad" and everything else was
// processed, and returns the poison row, checked.
func (r *replayRig) waitPoisoned() ops.PoisonedMessage {
	t := r.t
	testkit.Eventually(t, 90*time.Second, "billing's event poisoned, the rest processed", func() bool {
		return len(r.list()) == 1 && r.effects(r.billing, r.good) == 1 && r.effects(r.audit, r.good) == 1 && r.effects(r.audit, r.bad) == 1
	})
	row := r.list()[0]
	require.Equal(t, r.billing, row.ConsumerGroup)
	require.Equal(t, r.billing, row.Handler)
	require.Equal(t, r.bad, row.EventID)
	require.Equal(t, "permanent", row.ErrorClass)
	require.Contains(t, row.Reason, "no price list for order bad")
	require.Equal(t, ops.PoisonStatePoisoned, row.State)
	require.Nil(t, row.ProcessedAt, "a poisoned event's inbox row rolled back with its transaction")
	return row
}

// replayBeforeFix: a replay before the fix is poisoned again, in the
// same row.
func (r *replayRig) replayBeforeFix(row ops.PoisonedMessage, id string) {
	t := r.t
	res := r.replay(id)
	require.Len(t, res.Replayed, 1)
	require.NotEmpty(t, res.Replayed[0].MessageID)
	require.NotEqual(t, row.MessageID, res.Replayed[0].MessageID, "a replay has a message id of its own")
	testkit.Eventually(t, 90*time.Second, "the replay poisoned again and acked by the other group without processing", func() bool {
		s := r.show(id)
		return s.TimesPoisoned == 2 && s.ReplayedAt == nil && r.outcomes(r.audit, middleware.OutcomeNotTargeted) >= 1
	})
	require.Len(t, r.list(), 1, "poisoning a replay again updates the original row")
	require.Equal(t, row.MessageID, r.show(id).MessageID)
}

// dryRun: once fixed, a dry run says what it would replay and changes
// nothing.
func (r *replayRig) dryRun(row ops.PoisonedMessage, id string) {
	t := r.t
	var dry dryReplay
	cliJSON(t, r.path, &dry, "dlq", "replay", "--dry-run", id)
	require.True(t, dry.DryRun)
	require.Equal(t, []ops.ReplayedEntry{{ID: row.ID, ConsumerGroup: r.billing, Handler: r.billing, Topic: r.topic, EventID: r.bad, EventType: "OrderPlaced",
		TargetGroups: []string{r.billing}}}, dry.WouldReplay)
	require.Equal(t, 1, dry.WouldWrite)
	require.Equal(t, 1, r.show(id).ReplayCount, "a dry run records no replay")
	require.Nil(t, r.show(id).ReplayedAt)
}

// replayFixed: the replay of the fixed handler's events is processed
// exactly once, and the poison row says so.
func (r *replayRig) replayFixed(row ops.PoisonedMessage) {
	t := r.t
	id := strconv.FormatInt(row.ID, 10)
	res := r.replay("--topic", r.topic, "--not-replayed")
	require.Len(t, res.Replayed, 1)
	testkit.Eventually(t, 90*time.Second, "the replay processed by billing", func() bool { return r.effects(r.billing, r.bad) == 1 })
	var replayOf string
	require.NoError(t, r.db.QueryRow(`SELECT replay_of FROM "`+r.schema+`".effects WHERE grp = $1 AND event_id = $2`, r.billing, r.bad).Scan(&replayOf))
	require.Equal(t, row.MessageID, replayOf, "the handler sees which message the replay re-sends")
	testkit.Eventually(t, 90*time.Second, "the poison row shows the event processed", func() bool { return r.show(id).State == ops.PoisonStateProcessed })
	s := r.show(id)
	require.NotNil(t, s.ReplayedAt)
	require.NotNil(t, s.ProcessedAt)
	require.Equal(t, 2, s.ReplayCount)
	require.Equal(t, 2, s.TimesPoisoned)
}

// replayAgainIsSkipped: replaying it again is skipped, billing's inbox
// has the event.
func (r *replayRig) replayAgainIsSkipped(id string) {
	t := r.t
	res := r.replay(id)
	require.Empty(t, res.Replayed)
	require.Len(t, res.Skipped, 1)
	require.Equal(t, ops.SkipAlreadyProcessed, res.Skipped[0].Reason)
	require.Zero(t, res.Messages)
	code, out, errOut := cli(t, r.path, "dlq", "replay", id)
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "skipped "+id+" (group "+r.billing)
}

// forcedReplayIsADuplicate: forced, it is delivered again and billing's
// inbox acks it as a duplicate; audit acks every replay unprocessed.
func (r *replayRig) forcedReplayIsADuplicate(id string) {
	t := r.t
	before := r.outcomes(r.billing, middleware.OutcomeDuplicate)
	res := r.replay("--force", id)
	require.Len(t, res.Replayed, 1)
	testkit.Eventually(t, 90*time.Second, "billing acked the forced replay as a duplicate", func() bool {
		return r.outcomes(r.billing, middleware.OutcomeDuplicate) > before
	})
	testkit.Eventually(t, 90*time.Second, "audit acked all three replays without processing", func() bool {
		return r.outcomes(r.audit, middleware.OutcomeNotTargeted) >= 3
	})
}
