package ops_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/forwarder/wal"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/ops"
)

// walOps migrates a schema of its own for t on the server at url and
// returns the operations API of a WAL relay's config over it.
func walOps(t *testing.T, url string) *ops.Client {
	ctx := context.Background()
	db := testdb.OpenURL(t, url)
	var cfg bus.Config
	cfg.Database.URL = url
	cfg.Database.Schema = testdb.SchemaName(t, db, t.Name())
	cfg.Relay.Source = forwarder.SourceWAL
	cfg.Relay.WALSlot = testdb.UniqueName("ops")
	brokertest.Apply(t, bus.KindNATS, &cfg)
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	oc, err := ops.New(ctx, db, cfg)
	require.NoError(t, err)
	return oc
}

// The WAL relay's slot, on a private PostgreSQL with wal_level = logical:
// status before it exists, create (once: again is ErrSlotExists), a
// status that shows it, drop (once: again is ErrNoSlot).
func TestWALSlotLifecycle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	oc := walOps(t, servers.StartLogicalPostgreSQL(t).URL)
	slot := oc.Config().Relay.WALSlot

	st, err := oc.WALStatus(ctx)
	require.NoError(t, err)
	require.Equal(t, ops.WALSlot{Name: slot}, st)

	st, err = oc.CreateWALSlot(ctx)
	require.NoError(t, err)
	require.True(t, st.Exists)
	require.False(t, st.Active)
	require.Equal(t, "reserved", st.WALStatus)
	require.NotEqual(t, "0/0", st.ConfirmedFlushLSN)
	_, err = oc.CreateWALSlot(ctx)
	require.ErrorIs(t, err, wal.ErrSlotExists)

	st, err = oc.WALStatus(ctx)
	require.NoError(t, err)
	require.True(t, st.Exists)
	require.Equal(t, slot, st.Name)

	require.NoError(t, oc.DropWALSlot(ctx))
	require.ErrorIs(t, oc.DropWALSlot(ctx), wal.ErrNoSlot)
	st, err = oc.WALStatus(ctx)
	require.NoError(t, err)
	require.False(t, st.Exists)
}

// On a server whose wal_level is replica (the shared one), creating the
// slot says which setting to change, and creates nothing.
func TestWALCreateSlotNeedsLogicalWAL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	oc := walOps(t, testdb.URL())
	_, err := oc.CreateWALSlot(ctx)
	require.ErrorIs(t, err, wal.ErrWALLevel)
	require.ErrorContains(t, err, "ALTER SYSTEM SET wal_level = logical")
	st, err := oc.WALStatus(ctx)
	require.NoError(t, err)
	require.False(t, st.Exists)
}
