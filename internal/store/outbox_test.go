package store_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testdb"
)

// Backlog counts what Status counts as pending, before the group's offsets
// row exists, at its zero position and after acks, and never counts rows of
// a transaction that has not committed.
func TestBacklogCountsWhatStatusCountsAsPending(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Open(t)
	tables := store.Tables{Schema: testdb.Schema(t, db), OutboxTopic: "millrace_outbox"}
	require.NoError(t, store.Migrate(ctx, db, tables))
	const group = "relay_a"

	agree := func(want int64) {
		t.Helper()
		st, err := tables.Status(ctx, db, group)
		require.NoError(t, err)
		n, oldest, err := tables.Backlog(ctx, db, store.Cursor{Group: group})
		require.NoError(t, err)
		require.Equal(t, want, st.Pending)
		require.Equal(t, st.Pending, n)
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
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, tables.WriteOutbox(ctx, tx, outboxRows(prefix, n)))
		require.NoError(t, tx.Commit())
	}
	// The position moves to the acked'th committed row. The rows are found
	// directly rather than by ReadBatch, which hides them while any older
	// transaction of the shared cluster is open.
	acked := 0
	ackNext := func(n int) {
		t.Helper()
		acked += n
		var last store.OutboxRow
		var txID int64
		require.NoError(t, db.QueryRowContext(ctx, `SELECT "offset", transaction_id::text::bigint FROM `+tables.OutboxTable()+
			` ORDER BY transaction_id, "offset" OFFSET $1 LIMIT 1`, acked-1).Scan(&last.Offset, &txID))
		last.ExtraData = map[string]any{"transaction_id": txID}
		require.NoError(t, tables.Ack(ctx, db, store.Cursor{Group: group}, last))
	}

	agree(0)
	write("a", 5)
	write("b", 3)
	agree(8) // no offsets row yet: everything is pending
	require.NoError(t, tables.PrepareOffsets(ctx, db, store.Cursor{Group: group}))
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
}
