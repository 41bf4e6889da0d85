package store_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
)

const hour = 60 // minutes

// moveBack sets the time column of the rows query selects (by key, with one
// $1 parameter) to the start of the database's minute ago minutes back, and
// returns that instant.
func moveBack(t *testing.T, db *sql.DB, update string, ago int) time.Time {
	t.Helper()
	var at time.Time
	require.NoError(t, db.QueryRow(update, ago).Scan(&at))
	return at
}

// minuteOf is the index of the minute holding at in pm.
func minuteOf(pm store.PerMinute, at time.Time) int {
	return int(at.Sub(pm.Start) / time.Minute)
}

func sum(counts []int64) (n int64) {
	for _, c := range counts {
		n += c
	}
	return n
}

// ForwardedPerMinute counts each group's forwarded rows in the minute they
// were written: not the rows the group has not forwarded, nor those
// written more than an hour ago; a group that forwarded nothing has a
// minute of zero each.
func TestForwardedPerMinuteCountsEachGroupsForwardedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)

	empty, err := tables.ForwardedPerMinute(ctx, db, []string{"relay_a"}, 1, hour)
	require.NoError(t, err)
	require.Equal(t, map[string][]int64{"relay_a": make([]int64, hour)}, empty.Counts)
	require.Zero(t, empty.Start.Second(), "a minute's start")

	writeOutbox(t, db, tables, "a", 8)
	forward(t, db, tables, store.Cursor{Group: "relay_a"}, 6)
	forward(t, db, tables, store.Cursor{Group: "relay_c"}, -1)
	// Of relay_a's six: two written ten minutes ago, one two hours ago.
	move := `UPDATE ` + tables.OutboxTable() + ` SET created_at = date_trunc('minute', LOCALTIMESTAMP) - make_interval(mins => $1)
		WHERE "offset" IN (SELECT "offset" FROM ` + tables.OutboxTable() + ` ORDER BY "offset" %s)
		RETURNING created_at AT TIME ZONE current_setting('TimeZone')`
	var tenAgo time.Time
	rows, err := db.Query(fmt.Sprintf(move, "LIMIT 2"), 10)
	require.NoError(t, err)
	for rows.Next() {
		require.NoError(t, rows.Scan(&tenAgo))
	}
	require.NoError(t, rows.Err())
	moveBack(t, db, fmt.Sprintf(move, "OFFSET 2 LIMIT 1"), 120)

	pm, err := tables.ForwardedPerMinute(ctx, db, []string{"relay_a", "relay_b", "relay_c"}, 1, hour)
	require.NoError(t, err)
	require.Len(t, pm.Counts, 3)
	a := pm.Counts["relay_a"]
	require.Len(t, a, hour)
	require.Equal(t, int64(2), a[minuteOf(pm, tenAgo)], "the two rows moved ten minutes back")
	require.Equal(t, int64(5), sum(a), "six forwarded, one of them two hours old")
	require.Equal(t, make([]int64, hour), pm.Counts["relay_b"], "relay_b has no cursor: it forwarded nothing")
	require.Equal(t, int64(7), sum(pm.Counts["relay_c"]), "relay_c forwarded all eight")
}

// On a sharded outbox each shard's rows count once that shard's cursor of
// the group forwarded them.
func TestForwardedPerMinuteReadsEachShardsCursor(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)
	require.NoError(t, tables.RecordShards(ctx, db, "g", 4))
	writeEvents(t, db, tables, "o-1", "o-2", "o-3", "o-4", "o-5", "o-6", "o-7", "o-8")
	cs := cursors("g", 4)
	ackAll(t, db, tables, cs[0], cs[2])
	var want int64
	for _, shards := range shardOf(t, db, tables) {
		for _, s := range shards {
			if s == 0 || s == 2 {
				want++
			}
		}
	}
	pm, err := tables.ForwardedPerMinute(ctx, db, []string{"g"}, 4, hour)
	require.NoError(t, err)
	require.Equal(t, want, sum(pm.Counts["g"]))
	ackAll(t, db, tables, cs[1], cs[3])
	pm, err = tables.ForwardedPerMinute(ctx, db, []string{"g"}, 4, hour)
	require.NoError(t, err)
	require.Equal(t, int64(8), sum(pm.Counts["g"]))
}

// ProcessedPerMinute counts each consumer group's inbox rows of the last
// hour in the minute they were processed.
func TestProcessedPerMinuteCountsInboxRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)

	empty, err := tables.ProcessedPerMinute(ctx, db, hour)
	require.NoError(t, err)
	require.Empty(t, empty.Counts)
	require.False(t, empty.Start.IsZero(), "the window's start, without rows")

	for _, id := range []string{"e-1", "e-2", "e-3", "e-4"} {
		_, err := tables.MarkProcessed(ctx, db, "billing", id)
		require.NoError(t, err)
	}
	_, err = tables.MarkProcessed(ctx, db, "audit", "e-1")
	require.NoError(t, err)
	move := `UPDATE ` + tables.InboxTable() + ` SET processed_at = date_trunc('minute', now()) - make_interval(mins => $1)
		WHERE consumer_group = 'billing' AND event_id = '%s' RETURNING processed_at`
	thirtyAgo := moveBack(t, db, fmt.Sprintf(move, "e-1"), 30)
	moveBack(t, db, fmt.Sprintf(move, "e-2"), 61)

	pm, err := tables.ProcessedPerMinute(ctx, db, hour)
	require.NoError(t, err)
	require.Len(t, pm.Counts, 2)
	require.Equal(t, int64(1), pm.Counts["billing"][minuteOf(pm, thirtyAgo)])
	require.Equal(t, int64(3), sum(pm.Counts["billing"]), "four processed, one of them 61 minutes ago")
	require.Equal(t, int64(1), sum(pm.Counts["audit"]))
}
