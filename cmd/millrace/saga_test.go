package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/ops"
)

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
