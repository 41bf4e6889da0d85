package ops_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// Failures group by error class and normalised reason; a whole group is
// replayed and purged after a dry run, and an action whose selection
// changed since its dry run (a row replayed by someone else meanwhile)
// reports it and changes nothing.
func TestOpsFailureGroupsAndChangedSelections(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newOpsWorld(t)
	numbered := []string{"o-bad-1", "o-bad-2", "o-bad-33"}
	other := uuid.NewString()
	events := map[string]string{}
	w.markBad(true, append(numbered, other)...)
	for _, agg := range append(numbered, other) {
		events[agg] = w.publish(t, agg)
	}
	testkit.Eventually(t, time.Minute, "four messages poisoned", func() bool {
		l, err := w.ops.DLQ().List(ctx, ops.Filter{}, 0)
		return err == nil && len(l.Rows) == 4
	})

	g, list := checkFailureGroups(t, w, events[other])

	// The dry run of the group says what a replay would do.
	w.markBad(false, numbered...)
	group := ops.Selection{Filter: ops.Filter{Fingerprint: g.Fingerprint}}
	dry, err := w.ops.DLQ().Replay(ctx, group, ops.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, 3, dry.Messages)
	require.NotEmpty(t, dry.Selection)

	// Someone else replays one of them meanwhile.
	first := list.Rows[0]
	_, err = w.ops.DLQ().Replay(ctx, ops.Selection{IDs: []int64{first.ID}}, ops.ReplayOptions{By: "someone else"})
	require.NoError(t, err)
	testkit.Eventually(t, time.Minute, "the other replay processed", func() bool { return w.effects(first.EventID) == 1 })

	reviewed := group
	reviewed.Expect = dry.Selection
	_, err = w.ops.DLQ().Replay(ctx, reviewed, ops.ReplayOptions{By: "console"})
	var changed *ops.ChangedError
	require.ErrorAs(t, err, &changed)
	require.ErrorIs(t, err, ops.ErrChanged)
	require.Equal(t, 3, changed.Rows)
	again, err := w.ops.DLQ().List(ctx, ops.Filter{Fingerprint: g.Fingerprint}, 0)
	require.NoError(t, err)
	for _, m := range again.Rows {
		if m.ID != first.ID {
			require.Zero(t, m.ReplayCount, "a changed selection replays nothing")
		}
	}

	// Reviewed again, the replay goes ahead: the one processed meanwhile is
	// skipped, the others are replayed once and processed once.
	dry, err = w.ops.DLQ().Replay(ctx, group, ops.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, 2, dry.Messages)
	reviewed.Expect = dry.Selection
	res, err := w.ops.DLQ().Replay(ctx, reviewed, ops.ReplayOptions{By: "console"})
	require.NoError(t, err)
	require.Len(t, res.Replayed, 2)
	require.Len(t, res.Skipped, 1)
	require.Equal(t, first.ID, res.Skipped[0].ID)
	for _, agg := range numbered {
		testkit.Eventually(t, time.Minute, "each numbered event processed", func() bool { return w.effects(events[agg]) == 1 })
	}

	checkReviewedPurge(t, w, group, dry.Selection, first.ID)

	groups, err := w.ops.PoisonGroups(ctx, ops.Filter{})
	require.NoError(t, err)
	require.Len(t, groups, 1, "only the other group is left")

	statuses, err := w.ops.OutboxStatuses(ctx)
	require.NoError(t, err)
	require.Len(t, statuses, 1)
	require.Equal(t, w.ops.Config().Relay.ConsumerGroup, statuses[0].RelayGroup)
}

// checkFailureGroups checks the two failure groups of the poisoned
// messages (three numbered ones, one of event other) and returns the
// largest with its messages.
func checkFailureGroups(t *testing.T, w *opsWorld, other string) (ops.FailureGroup, ops.List[ops.PoisonedMessage]) {
	t.Helper()
	ctx := context.Background()
	groups, err := w.ops.PoisonGroups(ctx, ops.Filter{})
	require.NoError(t, err)
	require.Len(t, groups, 2, "%+v", groups)
	g := groups[0]
	require.Equal(t, int64(3), g.Messages, "the largest group first")
	require.Equal(t, int64(3), g.Waiting)
	require.Equal(t, middleware.ClassPermanent, g.ErrorClass)
	require.Contains(t, g.Reason, "payment gateway refused o-bad-<n>")
	require.Contains(t, g.Example, "payment gateway refused o-bad-")
	require.Equal(t, []string{w.group}, g.Handlers)
	require.Equal(t, []string{w.topic}, g.Topics)
	require.Contains(t, groups[1].Reason, "payment gateway refused <uuid>")
	require.Len(t, g.Fingerprint, 12)

	list, err := w.ops.DLQ().List(ctx, ops.Filter{Fingerprint: g.Fingerprint}, 0)
	require.NoError(t, err)
	require.Len(t, list.Rows, 3)
	for _, m := range list.Rows {
		require.Equal(t, g.Fingerprint, m.Fingerprint)
		require.NotEqual(t, other, m.EventID)
	}
	_, err = w.ops.DLQ().List(ctx, ops.Filter{Fingerprint: "not-hex"}, 0)
	require.ErrorIs(t, err, ops.ErrInvalidFilter)
	_, err = w.ops.PoisonGroups(ctx, ops.Filter{Fingerprint: "ABCDEF012345"})
	require.ErrorIs(t, err, ops.ErrInvalidFilter)
	return g, list
}

// checkReviewedPurge purges group, reviewed as the token stale says before
// its rows changed: refused, then reviewed again and purged; gone names an
// id of the group.
func checkReviewedPurge(t *testing.T, w *opsWorld, group ops.Selection, stale string, gone int64) {
	t.Helper()
	ctx := context.Background()
	// A purge reviewed before the group changed state changes nothing.
	purgeReviewed := group
	purgeReviewed.Expect = stale
	_, err := w.ops.DLQ().Purge(ctx, purgeReviewed, false)
	require.ErrorIs(t, err, ops.ErrChanged, "the rows were replayed and processed since")
	dryPurge, err := w.ops.DLQ().Purge(ctx, group, true)
	require.NoError(t, err)
	require.Len(t, dryPurge.Purged, 3)
	purgeReviewed.Expect = dryPurge.Selection
	purged, err := w.ops.DLQ().Purge(ctx, purgeReviewed, false)
	require.NoError(t, err)
	require.Len(t, purged.Purged, 3)
	// Purged meanwhile: acting on the ids again reports them missing.
	_, err = w.ops.DLQ().Purge(ctx, ops.Selection{IDs: []int64{gone}}, false)
	require.True(t, errors.Is(err, ops.ErrNotFound), "%v", err)
}

// markBad makes the handler fail on the events of aggs, or not.
func (w *opsWorld) markBad(bad bool, aggs ...string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, agg := range aggs {
		w.bad[agg] = bad
	}
}
