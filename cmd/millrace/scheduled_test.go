package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/ops"
)

// scheduled list shows what waits, soonest first; scheduled cancel deletes
// one and fails for an id that is no longer scheduled.
func TestScheduledCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _, path := migrated(t)
	cfg, err := bus.LoadConfig(path)
	require.NoError(t, err)
	b, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	defer b.Close()
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	for i, in := range []time.Duration{2 * time.Hour, time.Hour} {
		_, err := b.Schedule(ctx, tx, "orders.events", bus.DueIn(in), bus.Event{ID: []string{"ev-late", "ev-soon"}[i],
			Type: "PaymentReminderDue", AggregateType: "order", AggregateID: "o-1", Payload: []byte(`{}`)})
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit())

	var list ops.ScheduledList
	cliJSON(t, path, &list, "scheduled", "list")
	require.Equal(t, int64(2), list.Total)
	require.Len(t, list.Events, 2)
	require.Equal(t, "ev-soon", list.Events[0].ID, "soonest due first")
	require.Equal(t, "orders.events", list.Events[0].Topic)

	code, out, errOut := cli(t, path, "scheduled", "cancel", "ev-soon")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "cancelled scheduled event ev-soon")
	code, _, errOut = cli(t, path, "scheduled", "cancel", "ev-soon")
	require.Equal(t, exitFailed, code)
	require.Contains(t, errOut, "no such scheduled event")
	code, _, _ = cli(t, path, "scheduled", "cancel")
	require.Equal(t, exitUsage, code)

	code, out, errOut = cli(t, path, "scheduled", "list", "--limit", "1")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "ev-late")
}

// saga list and saga show read the saga table; an unknown instance fails.
func TestSagaCommands(t *testing.T) {
	t.Parallel()
	db, schema, path := migrated(t)
	_, err := db.Exec(`INSERT INTO "` + schema + `".millrace_sagas (saga_type, saga_id, state, version, step, timeouts)
		VALUES ('order_fulfilment', 'o-1', '{"Step":"charging"}', 1, 'OrderPlaced', '{"payment":"ev-timeout-1"}')`)
	require.NoError(t, err)

	var list ops.SagaList
	cliJSON(t, path, &list, "saga", "list")
	require.Len(t, list.Instances, 1)
	require.Equal(t, "o-1", list.Instances[0].ID)
	require.Equal(t, map[string]string{"payment": "ev-timeout-1"}, list.Instances[0].Timeouts)

	code, out, errOut := cli(t, path, "saga", "show", "order_fulfilment", "o-1")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "payment: scheduled event ev-timeout-1")
	require.Contains(t, out, `{"Step": "charging"}`)
	require.Contains(t, out, "last error: none")
	_, err = db.Exec(`INSERT INTO "` + schema + `".millrace_saga_errors (saga_type, saga_id, step, error, failed_at)
		VALUES ('order_fulfilment', 'o-1', 'PaymentCharged', 'card declined', now() + interval '1 minute')`)
	require.NoError(t, err)
	code, out, errOut = cli(t, path, "saga", "show", "order_fulfilment", "o-1")
	require.Equal(t, exitOK, code, errOut)
	require.Regexp(t, `last error: step PaymentCharged at \S+ \(the saga has not moved on since\): card declined`, out)
	var shown ops.SagaInstance
	cliJSON(t, path, &shown, "saga", "show", "order_fulfilment", "o-1")
	require.NotNil(t, shown.LastError)
	require.True(t, shown.LastError.Current)
	code, _, errOut = cli(t, path, "saga", "show", "order_fulfilment", "nobody")
	require.Equal(t, exitFailed, code)
	require.Contains(t, errOut, "not found")
}
