package main

import (
	"context"
	"database/sql"
	"encoding/hex"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/ops"
)

// Every command that reads or writes the database works when database.url
// sets one of pgx's query exec modes (default_query_exec_mode, what a
// pooler in transaction mode calls for), and shows and replays what it
// stored byte for byte.
func TestCommandsInEveryQueryExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"cache_statement", "cache_describe", "describe_exec", "exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			testCommandsInMode(t, mode)
		})
	}
}

func testCommandsInMode(t *testing.T, mode string) {
	ctx := context.Background()
	db := testdb.Open(t)
	schema := testdb.SchemaName(t, db, t.Name())
	u, err := url.Parse(testdb.URL())
	require.NoError(t, err)
	q := u.Query()
	q.Set("default_query_exec_mode", mode)
	u.RawQuery = q.Encode()
	path := migrateConfig(t, u.String(), schema, "")

	payload := []byte{0, 0xff, '\\', 'x', '\'', 0xc3, '"', '{'}
	metadata := map[string]string{"note": `Zoë's "quoted" back\slash \x41 $1 ☃`, "json": `{"a":[1]}`}
	id := insertPoison(t, db, schema, fixture{group: "billing", handler: "billing", topic: "orders", eventID: `e-'1"\`,
		eventType: "OrderCreated", reason: `boom "ü" \`, class: "permanent", payload: payload, metadata: metadata})
	ref := strconv.FormatInt(id, 10)
	var list poisonList
	cliJSON(t, path, &list, "dlq", "list", "--reason", `"Ü" \`, "--since", "1h")
	require.Len(t, list.Messages, 1)
	var groups struct {
		Groups []ops.FailureGroup `json:"groups"`
	}
	cliJSON(t, path, &groups, "dlq", "groups")
	require.Len(t, groups.Groups, 1)
	var show showResult
	cliJSON(t, path, &show, "dlq", "show", "--hex", ref)
	require.Equal(t, hex.EncodeToString(payload), show.Payload.Value)
	require.Equal(t, metadata, show.Metadata)

	var replay ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry]
	cliJSON(t, path, &replay, "dlq", "replay", ref)
	require.Len(t, replay.Replayed, 1)
	var status ops.OutboxStatus
	cliJSON(t, path, &status, "outbox", "status")
	require.EqualValues(t, 1, status.Pending, "the replay is in the outbox")
	var purged ops.PurgeResult[ops.PoisonedMessage]
	cliJSON(t, path, &purged, "dlq", "purge", ref)
	require.Len(t, purged.Purged, 1)

	cfg, err := bus.LoadConfig(path)
	require.NoError(t, err)
	b, err := bus.Open[*sql.DB](ctx, cfg, nil) // on database.url, in the mode
	require.NoError(t, err)
	defer b.Close()
	tx, err := b.DB().BeginTx(ctx, nil)
	require.NoError(t, err)
	ids, err := b.Schedule(ctx, tx, "orders", bus.DueIn(time.Hour), bus.Event{ID: `ev-"late"`, Type: "Reminder",
		AggregateType: "order", AggregateID: "o-1", Payload: []byte(`{"ü":"\\"}`)})
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	var scheduled ops.ScheduledList
	cliJSON(t, path, &scheduled, "scheduled", "list")
	require.Len(t, scheduled.Events, 1)
	code, _, errOut := cli(t, path, "scheduled", "cancel", ids[0])
	require.Equal(t, exitOK, code, errOut)

	var sagas ops.SagaList
	cliJSON(t, path, &sagas, "saga", "list", "--completed")
	require.Empty(t, sagas.Instances)
	var quarantined ops.List[ops.QuarantinedRow]
	cliJSON(t, path, &quarantined, "quarantine", "list", "--since", "1h")
	require.Empty(t, quarantined.Rows)
	var pruned ops.InboxPruneResult
	cliJSON(t, path, &pruned, "inbox", "purge", "--older-than", "1h", "--group", "billing")
	require.Zero(t, pruned.Deleted)
}
