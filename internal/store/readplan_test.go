package store_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
)

// A read reaches the rows of pending and young transactions through the
// primary key, so it walks none of the rows the relay forwarded before:
// through the (shard, offset) index it walked every row at or below the
// position on each read, which cost about 15 ms a read after a 50,000-row
// drain. Counted from the index's statistics, on one session.
func TestReadBatchWalksNoForwardedRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tables.WriteOutbox(ctx, tx, outboxRows("a", 2000)))
	require.NoError(t, tx.Commit())
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	c := store.Cursor{Group: "relay"}
	var pos store.Position
	for {
		b, err := tables.ReadBatch(ctx, conn, c, pos, 500)
		require.NoError(t, err)
		pos = pos.Advance(b, len(b.Rows), true)
		if len(b.Rows) == 0 {
			break
		}
	}
	require.EqualValues(t, 2000, pos.Offset)

	walked := func() (n int64) {
		t.Helper()
		_, err := conn.ExecContext(ctx, `SELECT pg_stat_force_next_flush()`)
		require.NoError(t, err)
		require.NoError(t, conn.QueryRowContext(ctx, `SELECT idx_tup_read FROM pg_stat_user_indexes
			WHERE indexrelid = to_regclass($1)`, tables.Schema+".watermill_millrace_outbox_offset").Scan(&n))
		return n
	}
	before := walked()
	_, err = tables.ReadBatch(ctx, conn, c, pos, 500)
	require.NoError(t, err)
	require.Zero(t, walked()-before, "index entries of forwarded rows walked by one read")
}
