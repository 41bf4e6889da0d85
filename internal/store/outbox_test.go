package store_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
)

// Backlog counts what Status counts as pending, before the group's offsets
// row exists, at its zero position and after acks, and never counts rows of
// a transaction that has not committed; HasBacklog says whether it counts
// any.
func TestBacklogCountsWhatStatusCountsAsPending(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)
	const group = "relay_a"

	agree := func(want int64) {
		t.Helper()
		st, err := tables.Status(ctx, db, group)
		require.NoError(t, err)
		n, oldest, err := tables.Backlog(ctx, db, store.Cursor{Group: group})
		require.NoError(t, err)
		require.Equal(t, want, st.Pending)
		require.Equal(t, st.Pending, n)
		found, err := tables.HasBacklog(ctx, db, store.Cursor{Group: group})
		require.NoError(t, err)
		require.Equal(t, want > 0, found)
		if want == 0 {
			require.Zero(t, oldest)
		} else {
			require.Positive(t, oldest)
			// Both measure from the same created_at; the later query sees it older.
			require.GreaterOrEqual(t, oldest, st.OldestPendingAge)
		}
	}
	write := func(prefix string, n int) {
		t.Helper()
		writeOutbox(t, db, tables, prefix, n)
	}
	// The position moves past the next n committed rows, as the relay
	// moves it.
	ackNext := func(n int) { t.Helper(); forward(t, db, tables, store.Cursor{Group: group}, n) }

	agree(0)
	write("a", 5)
	write("b", 3)
	agree(8) // no cursor row yet: everything is pending
	require.NoError(t, tables.PrepareCursor(ctx, db, store.Cursor{Group: group}))
	agree(8)
	ackNext(4) // to the middle of the first transaction's rows
	agree(4)
	ackNext(1) // to the end of the first transaction's rows
	agree(3)

	open, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer open.Rollback()
	require.NoError(t, tables.WriteOutbox(ctx, open, outboxRows("c", 2)))
	agree(3) // not committed, not pending
	ackNext(3)
	agree(0)
	write("d", 1)
	ackNext(1) // past the open transaction's rows, which it keeps pending
	agree(0)
	require.NoError(t, open.Commit())
	agree(2) // rows of a pending transaction, below the read offset
	ackNext(2)
	agree(0)
}

// forward acts as the relay of c: it takes c's lease, moves c's position
// past the next n committed rows (all of them when n < 0) by the read rule,
// and releases the lease.
func forward(t *testing.T, db *sql.DB, tables store.Tables, c store.Cursor, n int) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, tables.PrepareCursor(ctx, db, c))
	lease, pos, ok, err := tables.AcquireLease(ctx, db, c, "test", time.Minute, nil)
	require.NoError(t, err)
	require.True(t, ok, "the lease of %s is free", c.Row())
	defer func() { require.NoError(t, tables.ReleaseLease(ctx, db, lease)) }()
	for n != 0 {
		b, err := tables.ReadBatch(ctx, db, c, pos, 100)
		require.NoError(t, err)
		k := len(b.Rows)
		if n > 0 {
			k = min(k, n)
			n -= k
		}
		next := pos.Advance(b, k, c.Shards <= 1)
		require.NoError(t, tables.SavePosition(ctx, db, lease, pos, next))
		pos = next
		if len(b.Rows) == 0 || (n < 0 && b.Complete) {
			return
		}
	}
}
