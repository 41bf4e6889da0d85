package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testdb"
)

func writeConfig(t *testing.T, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(path, []byte(body), 0o600))
	return path
}

func TestMigrateCommand(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	schema := testdb.UniqueName(t.Name())
	t.Cleanup(func() { db.Exec(`DROP SCHEMA IF EXISTS "` + schema + `" CASCADE`) })
	path := writeConfig(t, "database:\n  url: "+testdb.URL()+"\n  schema: "+schema+"\nbroker:\n  nats:\n    url: nats://127.0.0.1:4222\n")

	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"--config", path, "migrate"}, &out, &errOut)
	require.Equal(t, exitOK, code, errOut.String())
	require.Contains(t, out.String(), schema)
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM information_schema.tables WHERE table_schema = $1`, schema).Scan(&n))
	require.Equal(t, 5, n, "outbox, offsets, inbox, poison and aggregate-versions tables")
}

func TestBadUsageExitsTwoWithUsageLine(t *testing.T) {
	t.Parallel()
	good := writeConfig(t, "broker:\n  nats:\n    url: nats://127.0.0.1:4222\n")
	bad := writeConfig(t, "broker:\n  kind: kafak\n")
	cases := map[string][]string{
		"no command":      {"--config", good},
		"unknown command": {"--config", good, "migrat"},
		"unknown flag":    {"--nope", "migrate"},
		"extra argument":  {"--config", good, "migrate", "now"},
		"bad config":      {"--config", bad, "migrate"},
	}
	for name, args := range cases {
		var out, errOut bytes.Buffer
		code := run(context.Background(), args, &out, &errOut)
		require.Equal(t, exitUsage, code, name)
		require.NotEmpty(t, errOut.String(), name)
	}
	var out, errOut bytes.Buffer
	require.Equal(t, exitUsage, run(context.Background(), []string{"--config", bad, "migrate"}, &out, &errOut))
	require.Contains(t, errOut.String(), `broker.kind: must be one of kafka, rabbitmq, nats; got "kafak"`)
	errOut.Reset()
	run(context.Background(), []string{"--config", good, "migrat"}, &out, &errOut)
	require.Contains(t, errOut.String(), "usage: millrace")
}
