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
