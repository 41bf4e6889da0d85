package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
)

// saga list and saga show read the saga table; an unknown instance fails.
func TestSagaCommands(t *testing.T) {
	t.Parallel()
	db, schema, path := migrated(t)
	_, err := db.Exec(`INSERT INTO "` + schema + `".millrace_sagas (saga_type, saga_id, state, version, step, timeouts)
		VALUES ('order_fulfilment', 'o-1', '{"Step":"charging"}', 1, 'OrderPlaced', '{"payment":"ev-timeout-1"}')`)
	require.NoError(t, err)

	var list bus.SagaList
	cliJSON(t, path, &list, "saga", "list")
	require.Len(t, list.Instances, 1)
	require.Equal(t, "o-1", list.Instances[0].ID)
	require.Equal(t, map[string]string{"payment": "ev-timeout-1"}, list.Instances[0].Timeouts)

	code, out, errOut := cli(t, path, "saga", "show", "order_fulfilment", "o-1")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "payment: scheduled event ev-timeout-1")
	require.Contains(t, out, `{"Step": "charging"}`)
	code, _, errOut = cli(t, path, "saga", "show", "order_fulfilment", "nobody")
	require.Equal(t, exitFailed, code)
	require.Contains(t, errOut, "not found")
}
