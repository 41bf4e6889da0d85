package main

import (
	"context"
	"database/sql"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/ops"
)

// park parks key behind a poisoned message of group's handler, as the
// consumer chain does, with n more messages behind it, and returns the
// poison row's id.
func park(t *testing.T, db *sql.DB, schema, group, key string, n int) int64 {
	t.Helper()
	ctx := context.Background()
	tables := store.Tables{Schema: schema}
	tx, err := db.Begin()
	require.NoError(t, err)
	now := time.Now()
	k := store.ParkKey{Group: group, Handler: group, Key: key}
	require.NoError(t, tables.StorePoisonedParked(ctx, tx, store.Poisoned{ConsumerGroup: group, Handler: group, SourceTopic: "orders",
		MessageID: key + "-m0", EventID: key + "-e0", EventType: "OrderPlaced", Payload: []byte(`{}`), Metadata: map[string]string{"aggregate-id": key},
		Reason: "boom", ErrorClass: "permanent", Attempts: 1, FirstFailureAt: now, LastFailureAt: now, PoisonedAt: now},
		k, store.ParkedMessage{MessageID: key + "-m0", Payload: []byte(`{}`)}))
	require.NoError(t, tx.Commit())
	for i := 1; i <= n; i++ {
		did, err := tables.AppendParked(ctx, db, k, store.ParkedMessage{MessageID: key + "-m" + strconv.Itoa(i)})
		require.NoError(t, err)
		require.Equal(t, store.Parked, did)
	}
	var id int64
	require.NoError(t, db.QueryRow(`SELECT id FROM "`+schema+`".millrace_poison WHERE message_id = $1`, key+"-m0").Scan(&id))
	return id
}

func TestParkedListSkipAndReplay(t *testing.T) {
	t.Parallel()
	db, schema, path := migrated(t)
	skipID := park(t, db, schema, "billing", "o-1", 2)
	replayID := park(t, db, schema, "billing", "o-2", 1)

	var list struct {
		Parked    []ops.ParkedAggregate `json:"parked"`
		Truncated bool                  `json:"truncated"`
	}
	cliJSON(t, path, &list, "dlq", "parked", "--group", "billing")
	require.Len(t, list.Parked, 2)
	require.Equal(t, "o-1", list.Parked[0].Key)
	require.Equal(t, ops.ParkStateHeld, list.Parked[0].State)
	require.Equal(t, 3, list.Parked[0].Parked, "the poisoned message and the two behind it")
	require.Equal(t, skipID, list.Parked[0].PoisonID)
	code, _, errOut := cli(t, path, "dlq", "parked", "--state", "stuck")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "--state")

	var dry struct {
		DryRun       bool                  `json:"dry_run"`
		Selection    string                `json:"selection"`
		WouldSkip    []ops.PoisonedMessage `json:"would_skip"`
		WouldRelease int                   `json:"would_release"`
	}
	cliJSON(t, path, &dry, "dlq", "skip", "--dry-run", strconv.FormatInt(skipID, 10))
	require.Equal(t, []int64{skipID}, idsOf(dry.WouldSkip))
	require.Equal(t, 1, dry.WouldRelease)
	code, out, errOut := cli(t, path, "dlq", "skip", strconv.FormatInt(skipID, 10))
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "skipped 1 message(s); 1 parked aggregate(s) flow on without them")
	code, out, errOut = cli(t, path, "dlq", "replay", strconv.FormatInt(replayID, 10))
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "its parked aggregate is released")

	cliJSON(t, path, &list, "dlq", "parked", "--state", "draining")
	require.Len(t, list.Parked, 2)
	require.Equal(t, 2, list.Parked[0].Parked, "the skipped message left o-1's list")
	require.Equal(t, 2, list.Parked[1].Parked, "the replayed message stays first in o-2's")
	var poisoned poisonList
	cliJSON(t, path, &poisoned, "dlq", "list", "--group", "billing")
	states := map[int64]string{}
	for _, m := range poisoned.Messages {
		states[m.ID] = m.State
	}
	require.Equal(t, map[int64]string{skipID: ops.PoisonStateSkipped, replayID: ops.PoisonStateReplayed}, states)
}
