package store_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

func rows(offsets ...int64) []store.OutboxRow {
	out := make([]store.OutboxRow, len(offsets))
	for i, o := range offsets {
		out[i] = store.OutboxRow{Offset: o}
	}
	return out
}

func snapshot(t *testing.T, s string) store.Snapshot {
	t.Helper()
	snap, err := store.ParseSnapshot(s)
	require.NoError(t, err)
	return snap
}

// Position.Advance on the cases its rule distinguishes; the randomized
// test in readrule_test.go runs it against PostgreSQL.
func TestAdvance(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		from      store.Position
		batch     store.Batch
		forwarded int
		whole     bool
		want      store.Position
	}{{
		name:  "an unbroken run of offsets: nothing can hide among them",
		from:  store.Position{Horizon: 5},
		batch: store.Batch{Rows: rows(1, 2, 3), Snapshot: snapshot(t, "8:10:8"), Complete: true}, forwarded: 3, whole: true,
		want: store.Position{Offset: 3, Horizon: 10, Pending: []store.PendingTx{{XID: 8}}},
	}, {
		name:  "a gap: the transactions in progress are pending, the young ones from 0",
		from:  store.Position{Horizon: 5},
		batch: store.Batch{Rows: rows(1, 3), Snapshot: snapshot(t, "4:9:4,7"), Complete: true}, forwarded: 2, whole: true,
		want: store.Position{Offset: 3, Horizon: 9, Pending: []store.PendingTx{{XID: 4, Done: 0}, {XID: 7, Done: 0}}},
	}, {
		name:  "a shard cannot see the other shards' offsets: in progress means pending",
		from:  store.Position{Offset: 3, Horizon: 9},
		batch: store.Batch{Rows: rows(4, 5), Snapshot: snapshot(t, "4:9:4"), Complete: true}, forwarded: 2,
		want: store.Position{Offset: 5, Horizon: 9, Pending: []store.PendingTx{{XID: 4, Done: 3}}},
	}, {
		name:  "an ended pending transaction whose rows were not all read keeps the rest",
		from:  store.Position{Offset: 10, Horizon: 12, Pending: []store.PendingTx{{XID: 4, Done: 2}}},
		batch: store.Batch{Rows: rows(5, 8), Snapshot: snapshot(t, "12:12:")}, forwarded: 1,
		want: store.Position{Offset: 10, Horizon: 12, Pending: []store.PendingTx{{XID: 4, Done: 5}}},
	}, {
		name:  "an ended young transaction forwarded whole leaves",
		from:  store.Position{Offset: 10, Horizon: 12},
		batch: store.Batch{Rows: rows(6, 11), Snapshot: snapshot(t, "14:14:"), Young: []uint64{13}, Complete: true}, forwarded: 2, whole: true,
		want: store.Position{Offset: 11, Horizon: 14},
	}, {
		name:  "a transaction still in progress stays pending as it was",
		from:  store.Position{Offset: 10, Horizon: 12, Pending: []store.PendingTx{{XID: 4, Done: 2}}},
		batch: store.Batch{Rows: rows(11), Snapshot: snapshot(t, "4:12:4"), Complete: true}, forwarded: 1, whole: true,
		want: store.Position{Offset: 11, Horizon: 12, Pending: []store.PendingTx{{XID: 4, Done: 2}}},
	}, {
		name:  "nothing confirmed: nothing moves but the horizon",
		from:  store.Position{Offset: 10, Horizon: 12, Pending: []store.PendingTx{{XID: 4, Done: 2}}},
		batch: store.Batch{Rows: rows(5, 11), Snapshot: snapshot(t, "13:13:"), Complete: true}, forwarded: 0,
		want: store.Position{Offset: 10, Horizon: 13, Pending: []store.PendingTx{{XID: 4, Done: 2}}},
	}} {
		t.Run(c.name, func(t *testing.T) {
			got := c.from.Advance(c.batch, c.forwarded, c.whole)
			require.True(t, c.want.Equal(got), "want %s, got %s", c.want, got)
		})
	}
}

func TestParseSnapshotRefusesMalformedText(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"", "1:2", "a:2:", "1:b:", "1:2:x", "1:2:3,", "1:2:3:4"} {
		_, err := store.ParseSnapshot(s)
		require.Error(t, err, s)
	}
	snap := snapshot(t, "10:20:15,12")
	require.Equal(t, store.Snapshot{Xmin: 10, Xmax: 20, Xip: []uint64{12, 15}}, snap)
}

// AwaitVisible waits while a transaction is in progress and returns once
// a new snapshot sees it ended; no transaction, no wait.
func TestAwaitVisible(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Open(t)
	tables := store.Tables{Schema: "public", OutboxTopic: "millrace_outbox"}
	require.NoError(t, tables.AwaitVisible(ctx, db, nil))

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	var text string
	require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_current_xact_id()::text`).Scan(&text))
	xid, err := strconv.ParseUint(text, 10, 64)
	require.NoError(t, err)

	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	err = tables.AwaitVisible(short, db, []uint64{xid})
	require.ErrorIs(t, err, context.DeadlineExceeded, "still in progress")

	require.NoError(t, tx.Commit())
	require.NoError(t, tables.AwaitVisible(ctx, db, []uint64{xid}))
}
