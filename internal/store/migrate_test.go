package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
)

// Migrate on an installed schema takes no lock on millrace's tables: a
// service that migrates at every start does not wait for a transaction
// left open with writes to them, nor hold up the writers behind it.
func TestMigrateWaitsForNoWriter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)
	open, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer open.Rollback()
	require.NoError(t, tables.WriteOutbox(ctx, open, outboxRows("open", 1)))
	for _, table := range []string{tables.InboxTable(), tables.PoisonTable(), tables.QuarantineTable(), tables.ScheduledTable(), tables.SagasTable()} {
		_, err := open.Exec(`LOCK TABLE ` + table + ` IN ROW EXCLUSIVE MODE`) // as a writer of each holds
		require.NoError(t, err)
	}
	migrated, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	require.NoError(t, store.Migrate(migrated, db, tables), "Migrate waited for the open transaction")
}
