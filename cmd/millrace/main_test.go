package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/ops"
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
	schema := testdb.SchemaName(t, db, t.Name())
	path := writeConfig(t, "database:\n  url: "+testdb.URL()+"\n  schema: "+schema+"\nbroker:\n  nats:\n    url: nats://127.0.0.1:4222\n")

	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"--config", path, "migrate"}, &out, &errOut)
	require.Equal(t, exitOK, code, errOut.String())
	require.Contains(t, out.String(), schema)
	for _, table := range []string{"watermill_millrace_outbox", "watermill_offsets_millrace_outbox", "millrace_inbox", "millrace_relay_quarantine", "millrace_poison", "millrace_poison_replays", "millrace_aggregate_versions"} {
		var exists bool
		require.NoError(t, db.QueryRow(`SELECT to_regclass($1) IS NOT NULL`, `"`+schema+`"."`+table+`"`).Scan(&exists))
		require.True(t, exists, table)
	}
}

func TestBadUsageExitsTwoWithUsageLine(t *testing.T) {
	t.Parallel()
	good := writeConfig(t, "broker:\n  nats:\n    url: nats://127.0.0.1:4222\n")
	bad := writeConfig(t, "broker:\n  kind: kafak\n")
	cases := map[string][]string{
		"no command":                {"--config", good},
		"unknown command":           {"--config", good, "migrat"},
		"unknown flag":              {"--nope", "migrate"},
		"extra argument":            {"--config", good, "migrate", "now"},
		"unknown flag of a command": {"--config", good, "outbox", "status", "--nope"},
		"group without subcommand":  {"--config", good, "outbox"},
		"bad config":                {"--config", bad, "relay"},
	}
	for name, args := range cases {
		var out, errOut bytes.Buffer
		code := run(context.Background(), args, &out, &errOut)
		require.Equal(t, exitUsage, code, name)
		require.NotEmpty(t, errOut.String(), name)
	}
	var out, errOut bytes.Buffer
	require.Equal(t, exitUsage, run(context.Background(), []string{"--config", bad, "relay"}, &out, &errOut))
	require.Contains(t, errOut.String(), `broker.kind: must be one of kafka, rabbitmq, nats; got "kafak"`)
	errOut.Reset()
	run(context.Background(), []string{"--config", good, "migrat"}, &out, &errOut)
	require.Contains(t, errOut.String(), "usage: millrace")
}

func TestOutboxStatusCommand(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	schema := testdb.SchemaName(t, db, t.Name())
	path := migrateConfig(t, testdb.URL(), schema, "")
	_, err := db.Exec(`INSERT INTO "` + schema + `"."watermill_millrace_outbox" (uuid, payload, metadata, transaction_id)
		VALUES ('u1', '{"destination_topic":"t","uuid":"e1","payload":"e30=","metadata":{}}', '{}', pg_current_xact_id())`)
	require.NoError(t, err)

	var out, errOut bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"--config", path, "outbox", "status", "--json"}, &out, &errOut), errOut.String())
	var st struct {
		Pending     int64 `json:"pending"`
		Quarantined int64 `json:"quarantined"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &st), out.String())
	require.EqualValues(t, 1, st.Pending)

	out.Reset()
	require.Equal(t, exitOK, run(context.Background(), []string{"--config", path, "outbox", "status"}, &out, &errOut))
	require.Contains(t, out.String(), "pending:             1")

	out.Reset()
	require.Equal(t, exitOK, run(context.Background(), []string{"outbox", "status", "--help"}, &out, &errOut))
	require.Contains(t, out.String(), "usage: millrace [--config config.yaml] outbox status")
}

func TestRelayCommandForwardsAndStopsOnSignal(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	schema := testdb.Schema(t, db)
	topic := "cli-relay-" + schema[len(schema)-8:]
	path := migrateConfig(t, testdb.URL(), schema, "")
	cfg, err := bus.LoadConfig(path)
	require.NoError(t, err)
	brokertest.Cleanup(t, bus.KindNATS, topic)
	b, err := bus.Open(context.Background(), cfg, db)
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, b.PublishInOwnTx(context.Background(), topic, bus.Event{Type: "T", AggregateType: "a", AggregateID: "1", Payload: []byte(`{}`)}))

	ctx, cancel := context.WithCancel(context.Background())
	code := make(chan int, 1)
	var relayOut, relayErr bytes.Buffer
	go func() { code <- run(ctx, []string{"--config", path, "relay"}, &relayOut, &relayErr) }()
	oc, err := ops.New(context.Background(), db, cfg)
	require.NoError(t, err)
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err := oc.OutboxStatus(context.Background(), "")
		require.NoError(t, err)
		if st.Pending == 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "the relay did not forward the event")
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	require.Equal(t, exitOK, <-code, relayErr.String())
}

// poisonList is the --json output of dlq list.
type poisonList struct {
	Messages  []ops.PoisonedMessage `json:"messages"`
	Truncated bool                  `json:"truncated"`
}
