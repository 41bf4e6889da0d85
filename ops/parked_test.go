package ops_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/ops"
)

// Parked aggregates through the operations API: an ordered handler parks
// the aggregates of two poisoned messages; the parks are listed; a replay
// of one lets its parked messages follow it in order, a skip of the other
// lets them flow on without it.
func TestOpsParkReplayAndSkip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newOpsWorld(t, func(cfg *bus.Config) { cfg.Consumer.Ordered = new(true) })
	w.bad["a1"], w.bad["a2"] = true, true
	a1 := []string{w.publish(t, "a1"), w.publish(t, "a1"), w.publish(t, "a1")}
	a2 := []string{w.publish(t, "a2"), w.publish(t, "a2")}
	a0 := w.publish(t, "a0")
	testkit.Eventually(t, time.Minute, "a0 handled, a1 and a2 parked behind their poisoned messages", func() bool {
		l, err := w.ops.Parked(ctx, ops.ParkedFilter{Group: w.group}, 0)
		return err == nil && w.effects(a0) == 1 && len(l.Rows) == 2 && l.Rows[0].Parked+l.Rows[1].Parked == 5
	})
	parks, err := w.ops.Parked(ctx, ops.ParkedFilter{Key: "a1", State: ops.ParkStateHeld}, 0)
	require.NoError(t, err)
	require.Len(t, parks.Rows, 1)
	p := parks.Rows[0]
	require.Equal(t, ops.ParkedAggregate{ConsumerGroup: w.group, Handler: w.group, Key: "a1", Topic: w.topic, State: ops.ParkStateHeld,
		PoisonID: p.PoisonID, Parked: 3, Since: p.Since}, p)
	_, err = w.ops.Parked(ctx, ops.ParkedFilter{State: "stuck"}, 0)
	require.ErrorIs(t, err, ops.ErrInvalidFilter)
	_, err = w.ops.Quarantine().Skip(ctx, ops.Selection{All: true}, true)
	require.ErrorIs(t, err, ops.ErrNotSupported)

	w.mu.Lock()
	w.bad = map[string]bool{}
	w.mu.Unlock()
	res, err := w.ops.DLQ().Replay(ctx, ops.Selection{IDs: []int64{p.PoisonID}}, ops.ReplayOptions{By: "tester"})
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1)
	require.True(t, res.Replayed[0].Parked)
	require.Zero(t, res.Messages, "a parked replay writes nothing to the outbox")
	a2Park, err := w.ops.Parked(ctx, ops.ParkedFilter{Key: "a2"}, 0)
	require.NoError(t, err)
	skip, err := w.ops.DLQ().Skip(ctx, ops.Selection{IDs: []int64{a2Park.Rows[0].PoisonID}}, false)
	require.NoError(t, err)
	require.Len(t, skip.Skipped, 1)
	require.Equal(t, 1, skip.Released)

	testkit.Eventually(t, time.Minute, "the parks drained", func() bool {
		l, err := w.ops.Parked(ctx, ops.ParkedFilter{}, 0)
		return err == nil && len(l.Rows) == 0 && w.effects(a1[2]) == 1 && w.effects(a2[1]) == 1
	})
	w.mu.Lock()
	order := slices.DeleteFunc(slices.Clone(w.order), func(id string) bool { return id == a0 })
	w.mu.Unlock()
	require.Equal(t, a1, slices.DeleteFunc(slices.Clone(order), func(id string) bool { return !slices.Contains(a1, id) }))
	require.Equal(t, a2[1:], slices.DeleteFunc(slices.Clone(order), func(id string) bool { return !slices.Contains(a2, id) }))
	require.Zero(t, w.effects(a2[0]), "the skipped message is not handled")
	skipped, err := w.ops.DLQ().Get(ctx, a2Park.Rows[0].PoisonID)
	require.NoError(t, err)
	require.Equal(t, ops.PoisonStateSkipped, skipped.State)
	require.NotNil(t, skipped.SkippedAt)
}
