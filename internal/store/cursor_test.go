package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
)

// A relay records its position only where it left its cursor. When the
// database loses the relay's last save (a standby promoted before it
// received it), the cursor is behind the relay's position: the next save
// is refused with ErrLeaseLost, saying why, and the cursor stays where the
// database has it, for the relay to start again from.
func TestSavePositionRefusesACursorThatMovedUnderTheRelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)
	c := store.Cursor{Group: "relay"}
	require.NoError(t, tables.PrepareCursor(ctx, db, c))
	lease, pos, ok, err := tables.AcquireLease(ctx, db, c, "test", time.Minute, nil)
	require.NoError(t, err)
	require.True(t, ok)
	forwardAll := func(from store.Position, prefix string) store.Position {
		t.Helper()
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, tables.WriteOutbox(ctx, tx, outboxRows(prefix, 3)))
		require.NoError(t, tx.Commit())
		b, err := tables.ReadBatch(ctx, db, c, from, 100)
		require.NoError(t, err)
		return from.Advance(b, len(b.Rows), true)
	}

	saved := forwardAll(pos, "a")
	require.NoError(t, tables.SavePosition(ctx, db, lease, pos, saved))
	// The database loses that save.
	require.NoError(t, tables.SavePosition(ctx, db, lease, saved, pos))
	next := forwardAll(saved, "b")
	err = tables.SavePosition(ctx, db, lease, saved, next)
	require.ErrorIs(t, err, store.ErrLeaseLost)
	require.ErrorContains(t, err, "not where this relay recorded it")

	require.NoError(t, tables.ReleaseLease(ctx, db, lease))
	_, again, ok, err := tables.AcquireLease(ctx, db, c, "test", time.Minute, nil)
	require.NoError(t, err)
	require.True(t, ok)
	require.True(t, again.Equal(pos), "the cursor is where the database had it (%s), not at %s", pos, again)
}
