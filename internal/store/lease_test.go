package store_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
)

// A lease goes to one relay at a time. Another takes it once it expired or
// was released, or at once when the session it is tied to is gone; every
// write of a relay that lost it (its fence is stale) changes nothing.
func TestALeaseFencesTheRelayThatLostIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables, c := relayCursor(t)
	const ttl = 300 * time.Millisecond

	a, pos, ok, err := tables.AcquireLease(ctx, db, c, "a", ttl, nil)
	require.NoError(t, err)
	require.True(t, ok)
	_, _, ok, err = tables.AcquireLease(ctx, db, c, "b", ttl, nil)
	require.NoError(t, err)
	require.False(t, ok, "the lease is held")
	lost, err := tables.RenewLeases(ctx, db, []store.Lease{a}, ttl)
	require.NoError(t, err)
	require.Empty(t, lost)

	time.Sleep(2 * ttl) // a stops renewing: its lease expires
	b, _, ok, err := tables.AcquireLease(ctx, db, c, "b", time.Minute, nil)
	require.NoError(t, err)
	require.True(t, ok, "an expired lease is free")
	require.Greater(t, b.Fence, a.Fence)
	moved := pos
	moved.Offset = 42
	require.ErrorIs(t, tables.SavePosition(ctx, db, a, pos, moved), store.ErrLeaseLost, "a's fence is stale")
	lost, err = tables.RenewLeases(ctx, db, []store.Lease{a}, ttl)
	require.NoError(t, err)
	require.Equal(t, []store.Lease{a}, lost)
	require.NoError(t, tables.ReleaseLease(ctx, db, a), "a stale release changes nothing")
	_, _, ok, err = tables.AcquireLease(ctx, db, c, "c", ttl, nil)
	require.NoError(t, err)
	require.False(t, ok, "b still holds it")

	// b's lease is tied to a session; once it closes, c takes it at once.
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	session, err := store.CurrentSession(ctx, conn)
	require.NoError(t, err)
	require.NoError(t, tables.ReleaseLease(ctx, db, b))
	b, _, ok, err = tables.AcquireLease(ctx, db, c, "b", time.Minute, &session)
	require.NoError(t, err)
	require.True(t, ok, "a released lease is free")
	_, _, ok, err = tables.AcquireLease(ctx, db, c, "c", time.Minute, nil)
	require.NoError(t, err)
	require.False(t, ok, "b's session lives")
	_ = conn.Raw(func(any) error { return driver.ErrBadConn }) // closes the connection instead of pooling it
	_ = conn.Close()
	require.Eventually(t, func() bool {
		_, _, ok, err = tables.AcquireLease(ctx, db, c, "c", time.Minute, nil)
		require.NoError(t, err)
		return ok
	}, time.Minute, 20*time.Millisecond, "the lease of a closed session is free before it expires")
}

// A relay records its position only where it left its cursor. When the
// database loses the relay's last save (a standby promoted before it
// received it), the cursor is behind the relay's position: the next save
// is refused with ErrLeaseLost, saying why, and the cursor stays where the
// database has it, for the relay to start again from.
func TestSavePositionRefusesACursorThatMovedUnderTheRelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables, c := relayCursor(t)
	lease, pos, ok, err := tables.AcquireLease(ctx, db, c, "test", time.Minute, nil)
	require.NoError(t, err)
	require.True(t, ok)
	forwardAll := func(from store.Position, prefix string) store.Position {
		t.Helper()
		writeOutbox(t, db, tables, prefix, 3)
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

// relayCursor prepares the cursor of the consumer group "relay" on a
// migrated schema of the test's own.
func relayCursor(t *testing.T) (*sql.DB, store.Tables, store.Cursor) {
	t.Helper()
	db, tables := migrated(t)
	c := store.Cursor{Group: "relay"}
	require.NoError(t, tables.PrepareCursor(context.Background(), db, c))
	return db, tables, c
}
