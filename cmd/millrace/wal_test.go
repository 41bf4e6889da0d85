package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/ops"
)

// millrace wal status | create-slot | drop-slot on a private PostgreSQL
// with wal_level = logical: drop-slot asks first, and a "no" (or no
// answer) drops nothing.
func TestWALCommands(t *testing.T) {
	t.Parallel()
	pg := servers.StartLogicalPostgreSQL(t)
	path := writeConfig(t, "database:\n  url: "+pg.URL+"\n  schema: "+testdb.UniqueName(t.Name())+
		"\nbroker:\n  nats:\n    url: nats://127.0.0.1:4222\nrelay:\n  source: wal\n  wal_slot: cli_slot\n")
	cli := func(input string, args ...string) (string, string, int) {
		var out, errOut bytes.Buffer
		code := runIO(context.Background(), append([]string{"--config", path}, args...), strings.NewReader(input), &out, &errOut)
		return out.String(), errOut.String(), code
	}
	_, errOut, code := cli("", "migrate")
	require.Equal(t, exitOK, code, errOut)

	out, errOut, code := cli("", "wal", "status")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "exists:               no")

	out, errOut, code = cli("", "wal", "create-slot", "--json")
	require.Equal(t, exitOK, code, errOut)
	var st ops.WALSlot
	require.NoError(t, json.Unmarshal([]byte(out), &st), out)
	require.True(t, st.Exists)
	require.Equal(t, "cli_slot", st.Name)
	_, errOut, code = cli("", "wal", "create-slot")
	require.Equal(t, exitFailed, code)
	require.Contains(t, errOut, "replication slot exists already")

	out, errOut, code = cli("", "wal", "status")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "wal_status:           reserved")

	_, errOut, code = cli("n\n", "wal", "drop-slot")
	require.Equal(t, exitFailed, code)
	require.Contains(t, errOut, `Drop replication slot "cli_slot"`)
	require.Contains(t, errOut, "not confirmed: nothing was changed")
	out, _, _ = cli("", "wal", "status")
	require.Contains(t, out, "active:               false", "a refused drop-slot dropped the slot")

	out, errOut, code = cli("yes\n", "wal", "drop-slot")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, `dropped slot "cli_slot"`)
	_, errOut, code = cli("", "wal", "drop-slot", "--yes")
	require.Equal(t, exitFailed, code)
	require.Contains(t, errOut, "replication slot does not exist")
}

// With relay.source: wal, grants ends with the REPLICATION and the
// publication the WAL relay needs, in text and in JSON; without, it does not.
func TestWALGrantsCommand(t *testing.T) {
	t.Parallel()
	for source, want := range map[string]bool{"wal": true, "table": false} {
		path := writeConfig(t, "database:\n  schema: billing\nbroker:\n  nats: {url: nats://127.0.0.1:4222}\nrelay:\n  source: "+source+"\n")
		var out, errOut bytes.Buffer
		require.Equal(t, exitOK, run(context.Background(), []string{"--config", path, "grants", "--role", "billing_app"}, &out, &errOut), errOut.String())
		require.Equal(t, want, strings.Contains(out.String(), "\nALTER ROLE \"billing_app\" REPLICATION;\n"), source)
		require.Equal(t, want, strings.Contains(out.String(), `CREATE PUBLICATION "millrace_billing_millrace_outbox" FOR TABLE "billing"."watermill_millrace_outbox"`), source)
		out.Reset()
		require.Equal(t, exitOK, run(context.Background(), []string{"--config", path, "grants", "--role", "billing_app", "--json"}, &out, &errOut))
		require.Equal(t, want, strings.Contains(out.String(), `"privilege": "REPLICATION"`), source)
	}
}
