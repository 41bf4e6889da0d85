package bus_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// TestNewcomersJourney walks, on every broker, what a new adopter does
// with the README, on one topic of one schema:
//
//  1. two event types on the topic, OrderPlaced and OrderCancelled, each
//     with a typed handler and consumer group of its own (billing and
//     support, Topic.Handle) that acks the other's type unprocessed
//     (outcome other_type), beside audit, which routes both
//     (HandleTypes); every effect is written in the handler's transaction
//     (bus.Tx) and nothing of another type is poisoned;
//  2. handlers that fail their first attempts for some events and have
//     exactly one effect per event in the end;
//  3. a permanent error (bus.Permanent): in the DLQ at once, after one
//     attempt;
//  4. an event that used up its retries while a dependency was down: once
//     it is back, replayed through the ops API (what `millrace dlq replay`
//     calls), it has one effect, in billing only (the other groups ack the
//     replay as not_targeted), nothing is quarantined and the DLQ shows it
//     replayed and processed;
//  5. the README's "Switching brokers" procedure (drain, stop, switch
//     broker.kind, start) to another kind, so that each kind is both a
//     source and a target: the events published after the switch arrive
//     once each, and a service left on the old kind is refused at Open
//     while events for the new one are pending.
func TestNewcomersJourney(t *testing.T) {
	t.Parallel()
	switchTo := map[string]string{bus.KindNATS: bus.KindRabbitMQ, bus.KindRabbitMQ: bus.KindKafka, bus.KindKafka: bus.KindNATS}
	brokertest.EachKind(t, func(t *testing.T, kind string) {
		started := time.Now()
		j := newJourney(t, kind, switchTo[kind])
		stop := j.firstSteps()
		j.switchBrokers(stop)
		t.Logf("%s -> %s: the journey took %s", kind, j.to, time.Since(started).Round(100*time.Millisecond))
	})
}

const (
	// journeyAttempts is retry.max_attempts; flaky handlers fail their
	// first journeyFlakyFailures attempts.
	journeyAttempts      = 4
	journeyFlakyFailures = 2
)

// journey is a newcomer's service: a replayWorld (schema, topic, effects
// table, ops) on broker kind `from`, switched to `to` at the end.
type journey struct {
	t        *testing.T
	w        *replayWorld
	from, to string
	cfg      bus.Config // the service's config on `from`
	placed   *bus.Topic[placedV2]
	cancel   *bus.Topic[cancelled]
	fixed    atomic.Bool // the tax service billing needs for "doomed" orders is back
}

var journeyGroups = []string{"billing", "support", "audit"}

func newJourney(t *testing.T, from, to string) *journey {
	w := newReplayWorld(t, from, journeyGroups...)
	brokertest.Cleanup(t, to, w.topic, journeyGroups...)
	j := &journey{t: t, w: w, from: from, to: to,
		placed: bus.Must(bus.NewTopic[placedV2](w.topic)),
		cancel: bus.Must(bus.NewTopic[cancelled](w.topic))}
	j.cfg = j.config(from)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("effects (total, distinct events) by group: %v", j.effectCounts())
		}
	})
	return j
}

// config is the service's config on broker kind: short retry backoffs.
func (j *journey) config(kind string) bus.Config {
	cfg := j.w.cfg
	cfg.Broker = bus.BrokerConfig{}
	brokertest.Apply(j.t, kind, &cfg)
	cfg.Consumer.Retry = middleware.RetryConfig{MaxAttempts: journeyAttempts,
		InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond}
	return cfg
}

// register registers the service's handlers on b. The order id says how
// billing and support behave: "flaky" fails the first attempts, "refused"
// is refused for good, "doomed" fails until the tax service is back.
func (j *journey) register(b *bus.Bus) error {
	billing := func(ctx context.Context, m bus.Message[placedV2]) error {
		switch id := m.Value.OrderID; {
		case strings.HasPrefix(id, "flaky") && m.Attempt <= journeyFlakyFailures:
			return fmt.Errorf("billing: the price service timed out (attempt %d)", m.Attempt)
		case strings.HasPrefix(id, "refused"):
			return bus.Permanent(errors.New("billing: no price list for this market"))
		case strings.HasPrefix(id, "doomed") && !j.fixed.Load():
			return errors.New("billing: the tax service is unavailable")
		}
		return j.w.effect(ctx, "billing", m.Event)
	}
	support := func(ctx context.Context, m bus.Message[cancelled]) error {
		if strings.HasPrefix(m.Value.OrderID, "flaky") && m.Attempt <= journeyFlakyFailures {
			return fmt.Errorf("support: the ticket service timed out (attempt %d)", m.Attempt)
		}
		return j.w.effect(ctx, "support", m.Event)
	}
	return errors.Join(
		j.placed.Handle(b, "billing", billing),
		j.cancel.Handle(b, "support", support),
		b.HandleTypes("audit", []bus.Route{
			bus.On(j.placed, func(ctx context.Context, m bus.Message[placedV2]) error { return j.w.effect(ctx, "audit", m.Event) }),
			bus.On(j.cancel, func(ctx context.Context, m bus.Message[cancelled]) error { return j.w.effect(ctx, "audit", m.Event) }),
		}))
}

// publish commits an OrderPlaced for each of placed and an OrderCancelled
// for each of cancel in one transaction, through b.
func (j *journey) publish(b *bus.Bus, placed, cancel []string) {
	j.t.Helper()
	ctx := context.Background()
	tx, err := j.w.db.BeginTx(ctx, nil)
	require.NoError(j.t, err)
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	for _, id := range placed {
		require.NoError(j.t, j.placed.Publish(ctx, b, tx, placedV2{OrderID: id, TotalCents: 1000}))
	}
	for _, id := range cancel {
		require.NoError(j.t, j.cancel.Publish(ctx, b, tx, cancelled{OrderID: id, Reason: "changed mind"}))
	}
	require.NoError(j.t, tx.Commit())
}

// effectCount is a group's effects and the distinct events they are of:
// equal when every event took effect once.
type effectCount struct{ total, events int }

func (j *journey) effectCounts() map[string]effectCount {
	rows, err := j.w.db.Query(`SELECT grp, count(*), count(DISTINCT event_id) FROM "` + j.w.cfg.Database.Schema + `".effects GROUP BY grp`)
	require.NoError(j.t, err)
	defer rows.Close()
	counts := map[string]effectCount{}
	for rows.Next() {
		var group string
		var c effectCount
		require.NoError(j.t, rows.Scan(&group, &c.total, &c.events))
		counts[group] = c
	}
	require.NoError(j.t, rows.Err())
	return counts
}

// once waits until each group has taken effect exactly once for its
// number of events in want, and until holds.
func (j *journey) once(what string, want map[string]int, until func() bool) {
	j.t.Helper()
	expected := map[string]effectCount{}
	for group, n := range want {
		expected[group] = effectCount{n, n}
	}
	testkit.Eventually(j.t, 2*time.Minute, what, func() bool {
		return maps.Equal(j.effectCounts(), expected) && until()
	})
}

// poisoned lists the DLQ as `millrace dlq list` does, by order id.
func (j *journey) poisoned(f ops.Filter) map[string]ops.PoisonedMessage {
	j.t.Helper()
	l, err := j.w.ops.DLQ().List(context.Background(), f, 0)
	require.NoError(j.t, err)
	byOrder := map[string]ops.PoisonedMessage{}
	for _, m := range l.Rows {
		byOrder[m.AggregateID] = m
	}
	require.Len(j.t, byOrder, len(l.Rows), "one poisoned message per order")
	return byOrder
}

// firstSteps walks steps 1 to 4 on the first broker and returns the func
// that stops the service.
func (j *journey) firstSteps() (stop func()) {
	t := j.t
	reg := prometheus.NewRegistry()
	b, stop := j.w.serve(t, j.cfg, j.register, bus.WithRegistry(reg))
	j.publish(b, []string{"ok-1", "ok-2", "flaky-3", "refused-4", "doomed-5"}, []string{"ok-6", "flaky-7"})

	// Billing has the 3 orders it could bill, support both cancellations,
	// audit all 7 events; each group acked the other's type unprocessed;
	// the refused and the doomed order are in the DLQ.
	j.once("every event handled or poisoned", map[string]int{"billing": 3, "support": 2, "audit": 7}, func() bool {
		return len(j.poisoned(ops.Filter{})) == 2 &&
			outcomes(t, reg, "billing", middleware.OutcomeOtherType) == 2 &&
			outcomes(t, reg, "support", middleware.OutcomeOtherType) == 5
	})
	dlq := j.poisoned(ops.Filter{})
	refused, doomed := dlq["refused-4"], dlq["doomed-5"]
	require.Equal(t, "billing", refused.ConsumerGroup)
	require.Equal(t, 1, refused.Attempts, "a permanent error is not retried")
	require.Equal(t, middleware.ClassPermanent, refused.ErrorClass)
	require.Contains(t, refused.Reason, "no price list")
	require.Equal(t, "billing", doomed.ConsumerGroup)
	require.Equal(t, journeyAttempts, doomed.Attempts, "poisoned once its retries were used up")
	require.Equal(t, middleware.ClassTransient, doomed.ErrorClass)
	require.Contains(t, doomed.Reason, "tax service")
	for _, m := range dlq {
		require.Equal(t, ops.PoisonStatePoisoned, m.State)
	}
	for group, n := range map[string]float64{"billing": 2, "support": 0, "audit": 0} {
		require.EqualValues(t, n, outcomes(t, reg, group, middleware.OutcomePoisoned), group)
		require.Zero(t, outcomes(t, reg, group, middleware.OutcomeNotTargeted), group)
	}
	require.Zero(t, outcomes(t, reg, "audit", middleware.OutcomeOtherType), "audit routes both types")

	j.fixed.Store(true)
	j.replay(reg, doomed)
	return stop
}

// replay replays doomed from the DLQ, as `millrace dlq replay ID` does,
// and checks that it took effect once, in billing only.
func (j *journey) replay(reg *prometheus.Registry, doomed ops.PoisonedMessage) {
	t, ctx := j.t, context.Background()
	res, err := j.w.ops.DLQ().Replay(ctx, ops.Selection{IDs: []int64{doomed.ID}}, ops.ReplayOptions{By: "newcomer"})
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1)
	require.Equal(t, []string{"billing"}, res.Replayed[0].TargetGroups)
	require.Empty(t, res.Skipped)
	j.once("the replay billed, the other groups acked it", map[string]int{"billing": 4, "support": 2, "audit": 7}, func() bool {
		d, err := j.w.ops.DLQ().Get(ctx, doomed.ID)
		require.NoError(t, err)
		return d.State == ops.PoisonStateProcessed &&
			outcomes(t, reg, "support", middleware.OutcomeNotTargeted) == 1 &&
			outcomes(t, reg, "audit", middleware.OutcomeNotTargeted) == 1
	})
	require.Equal(t, 1, j.w.effects(t, "billing", doomed.EventID))
	require.Equal(t, 1, j.w.effects(t, "audit", doomed.EventID), "audit's effect of the first delivery only")
	require.Zero(t, j.w.effects(t, "support", doomed.EventID))
	require.Zero(t, outcomes(t, reg, "billing", middleware.OutcomeNotTargeted))

	q, err := j.w.ops.Quarantine().List(ctx, ops.Filter{}, 0)
	require.NoError(t, err)
	require.Empty(t, q.Rows, "nothing in the relay quarantine")
	replayed, waiting := true, false
	require.Equal(t, []string{"doomed-5"}, slices.Sorted(maps.Keys(j.poisoned(ops.Filter{Replayed: &replayed}))))
	require.Equal(t, []string{"refused-4"}, slices.Sorted(maps.Keys(j.poisoned(ops.Filter{Replayed: &waiting}))))
	d, err := j.w.ops.DLQ().Get(ctx, doomed.ID)
	require.NoError(t, err)
	require.Equal(t, 1, d.ReplayCount)
	require.Len(t, d.Replays, 1)
	require.Equal(t, "newcomer", d.Replays[0].ReplayedBy)
}

// switchBrokers follows the README's "Switching brokers": the publishers
// stopped, the relay drains the outbox, the service stops (stopFrom),
// broker.kind changes, and the service starts on the new kind.
func (j *journey) switchBrokers(stopFrom func()) {
	t, ctx := j.t, context.Background()
	j.drained(j.from)
	stopFrom()

	cfg := j.config(j.to)
	reg := prometheus.NewRegistry()
	b, stop := j.w.serve(t, cfg, j.register, bus.WithRegistry(reg))
	j.publish(b, []string{"after-8", "after-9"}, []string{"after-10"})
	j.once("the events published after the switch handled once", map[string]int{"billing": 6, "support": 3, "audit": 10}, func() bool {
		return outcomes(t, reg, "billing", middleware.OutcomeOtherType) == 1 &&
			outcomes(t, reg, "support", middleware.OutcomeOtherType) == 2
	})
	j.drained(j.to)
	stop()

	// An event for the new kind waits (no relay runs): a service still
	// configured for the old kind is refused at Open.
	publisher, err := bus.Open(ctx, cfg, j.w.db)
	require.NoError(t, err)
	j.publish(publisher, []string{"late-11"}, nil)
	publisher.Close()
	_, err = bus.Open(ctx, j.cfg, j.w.db)
	require.ErrorIs(t, err, forwarder.ErrBrokerChanged)
	require.ErrorContains(t, err, fmt.Sprintf("%q", j.from))
	require.ErrorContains(t, err, fmt.Sprintf("%q", j.to))

	j.w.serve(t, cfg, j.register)
	j.once("the waiting event handled once", map[string]int{"billing": 7, "support": 3, "audit": 11}, func() bool { return true })
	j.drained(j.to)
	require.Len(t, j.poisoned(ops.Filter{}), 2, "the DLQ holds what it held before the switch")
}

// drained waits until the outbox has nothing pending, relayed to kind,
// and checks that the relay quarantined nothing.
func (j *journey) drained(kind string) {
	j.t.Helper()
	var st ops.OutboxStatus
	testkit.Eventually(j.t, time.Minute, "the outbox drained", func() bool {
		var err error
		st, err = j.w.ops.OutboxStatus(context.Background(), "")
		require.NoError(j.t, err)
		return st.Pending == 0
	})
	require.Equal(j.t, kind, st.Broker)
	require.Zero(j.t, st.Quarantined)
}
