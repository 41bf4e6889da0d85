package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// cli runs the tool with the config at path and returns its exit code, stdout and stderr.
func cli(t *testing.T, path string, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), append([]string{"--config", path}, args...), &out, &errOut)
	return code, out.String(), errOut.String()
}

// cliJSON runs a command that must succeed and decodes its --json output into v.
func cliJSON(t *testing.T, path string, v any, args ...string) {
	t.Helper()
	code, out, errOut := cli(t, path, append(args, "--json")...)
	require.Equal(t, exitOK, code, "%v: %s", args, errOut)
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(v), out)
}

// migrated returns a pool, a migrated schema of the test's own and a config file pointing at it.
func migrated(t *testing.T) (*sql.DB, string, string) {
	t.Helper()
	db := testdb.Open(t)
	schema := testdb.Schema(t, db)
	return db, schema, migrateConfig(t, testdb.URL(), schema, "")
}

// migrateConfig writes a config file for the database at url, schema and
// the NATS broker, followed by extra YAML, runs `millrace migrate` with it
// and returns its path.
func migrateConfig(t *testing.T, url, schema, extra string) string {
	t.Helper()
	path := writeConfig(t, "database:\n  url: "+url+"\n  schema: "+schema+"\nbroker:\n  nats:\n    url: nats://127.0.0.1:4222\n"+extra)
	code, _, errOut := cli(t, path, "migrate")
	require.Equal(t, exitOK, code, errOut)
	return path
}

type fixture struct {
	group, handler, topic, eventID, eventType, reason, class string
	payload                                                  []byte
	metadata                                                 map[string]string
	poisonedAgo                                              time.Duration
	replayed, processed                                      bool
}

// insertPoison stores f in the poison table as the consumer middleware does
// and returns its id.
func insertPoison(t *testing.T, db *sql.DB, schema string, f fixture) int64 {
	t.Helper()
	meta, err := json.Marshal(f.metadata)
	require.NoError(t, err)
	if f.metadata == nil {
		meta = []byte(`{}`)
	}
	if f.payload == nil {
		f.payload = []byte(`{}`)
	}
	var id int64
	require.NoError(t, db.QueryRow(`INSERT INTO "`+schema+`".millrace_poison
	(consumer_group, handler, source_topic, message_id, event_id, event_type, payload, metadata,
	 reason, error_class, attempts, first_failure_at, last_failure_at, traceparent, poisoned_at, replayed_at)
VALUES ($1, $2, $3, $4, $4, $5, $6, $7, $8, $9, 3, now() - make_interval(secs => $10 + 5), now() - make_interval(secs => $10),
	'00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01', now() - make_interval(secs => $10),
	CASE WHEN $11 THEN now() ELSE NULL END) RETURNING id`,
		f.group, f.handler, f.topic, f.eventID, f.eventType, f.payload, meta, f.reason, f.class,
		f.poisonedAgo.Seconds(), f.replayed).Scan(&id))
	if f.processed {
		_, err := db.Exec(`INSERT INTO "`+schema+`".millrace_inbox (consumer_group, event_id) VALUES ($1, $2)`, f.group, f.eventID)
		require.NoError(t, err)
	}
	return id
}

func idsOf(rows []ops.PoisonedMessage) []int64 {
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.ID
	}
	return ids
}

func TestDLQListFiltersAndStates(t *testing.T) {
	t.Parallel()
	db, schema, path := migrated(t)
	gateway := insertPoison(t, db, schema, fixture{group: "billing", handler: "billing", topic: "orders", eventID: "e-1",
		eventType: "OrderCreated", reason: "payment gateway said NO\nsecond line", class: "transient", poisonedAgo: 3 * time.Hour})
	decode := insertPoison(t, db, schema, fixture{group: "shipping", handler: "ship", topic: "orders", eventID: "e-2",
		eventType: "OrderCreated", reason: "payload.address: missing", class: "permanent", poisonedAgo: 30 * time.Minute, replayed: true})
	timeout := insertPoison(t, db, schema, fixture{group: "billing", handler: "billing", topic: "invoices", eventID: "e-3",
		eventType: "InvoiceIssued", reason: "context deadline exceeded", class: "transient", poisonedAgo: 10 * time.Minute, processed: true})

	list := func(args ...string) poisonList {
		var res poisonList
		cliJSON(t, path, &res, append([]string{"dlq", "list"}, args...)...)
		return res
	}
	all := list()
	require.Equal(t, []int64{timeout, decode, gateway}, idsOf(all.Messages), "newest first")
	require.False(t, all.Truncated)
	byID := map[int64]ops.PoisonedMessage{}
	for _, r := range all.Messages {
		byID[r.ID] = r
	}
	require.Equal(t, ops.PoisonStatePoisoned, byID[gateway].State)
	require.Equal(t, ops.PoisonStateReplayed, byID[decode].State)
	require.NotNil(t, byID[decode].ReplayedAt)
	require.Equal(t, ops.PoisonStateProcessed, byID[timeout].State)
	require.NotNil(t, byID[timeout].ProcessedAt)
	g := byID[gateway]
	require.Equal(t, "billing", g.ConsumerGroup)
	require.Equal(t, "orders", g.Topic)
	require.Equal(t, "e-1", g.EventID)
	require.Equal(t, "payment gateway said NO\nsecond line", g.Reason, "JSON has the whole reason")
	require.Equal(t, 3, g.Attempts)
	require.Equal(t, 1, g.TimesPoisoned)
	require.Equal(t, 2, g.PayloadBytes)
	require.True(t, g.FirstFailureAt.Before(g.LastFailureAt))

	since := time.Now().Add(-20 * time.Minute).UTC().Format(time.RFC3339)
	cases := []struct {
		args []string
		want []int64
	}{
		{[]string{"--topic", "orders"}, []int64{decode, gateway}},
		{[]string{"--handler", "billing"}, []int64{timeout, gateway}},
		{[]string{"--group", "shipping"}, []int64{decode}},
		{[]string{"--reason", "GATEWAY"}, []int64{gateway}},
		{[]string{"--reason", "100%_"}, []int64{}},
		{[]string{"--since", "1h"}, []int64{timeout, decode}},
		{[]string{"--until", "1h"}, []int64{gateway}},
		{[]string{"--since", "1d", "--until", "20m"}, []int64{decode, gateway}},
		{[]string{"--since", since}, []int64{timeout}},
		{[]string{"--replayed"}, []int64{decode}},
		{[]string{"--not-replayed"}, []int64{timeout, gateway}},
		{[]string{"--topic", "orders", "--not-replayed"}, []int64{gateway}},
	}
	for _, c := range cases {
		require.Equal(t, c.want, idsOf(list(c.args...).Messages), "%v", c.args)
	}
	limited := list("--limit", "2")
	require.Equal(t, []int64{timeout, decode}, idsOf(limited.Messages))
	require.True(t, limited.Truncated)

	code, out, errOut := cli(t, path, "dlq", "list")
	require.Equal(t, exitOK, code, errOut)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 4, out)
	require.Regexp(t, `^ID\s+POISONED AT\s+GROUP\s+HANDLER\s+TOPIC\s+EVENT TYPE\s+AGGREGATE\s+CLASS\s+TIMES\s+STATE\s+REASON$`, lines[0])
	require.Regexp(t, `^`+strconv.FormatInt(gateway, 10)+`\s.*billing\s+billing\s+orders\s+OrderCreated\s+-\s+transient\s+1\s+poisoned\s+payment gateway said NO…$`, lines[3])
	code, out, _ = cli(t, path, "dlq", "list", "--group", "nobody")
	require.Equal(t, exitOK, code)
	require.Equal(t, "no poisoned messages match\n", out)
	_, out, _ = cli(t, path, "dlq", "list", "--limit", "1")
	require.Contains(t, out, "raise --limit")
}

func TestDLQShow(t *testing.T) {
	t.Parallel()
	db, schema, path := migrated(t)
	jsonID := insertPoison(t, db, schema, fixture{group: "billing", handler: "billing", topic: "orders", eventID: "e-json",
		eventType: "OrderCreated", reason: "payment declined\nby the gateway", class: "permanent",
		payload: []byte(`{"order":"o-1","lines":[1,2]}`), metadata: map[string]string{"event-id": "e-json", "content-type": "application/json"}})
	binary := []byte{0x00, 0xff, 0x10, 'h', 'i'}
	binID := insertPoison(t, db, schema, fixture{group: "billing", handler: "billing", topic: "orders", eventID: "e-bin",
		eventType: "Blob", reason: "cannot decode", class: "permanent", payload: binary})

	var res showResult
	var raw map[string]any
	cliJSON(t, path, &raw, "dlq", "show", strconv.FormatInt(jsonID, 10))
	require.Equal(t, "json", raw["payload"].(map[string]any)["encoding"])
	require.Equal(t, map[string]any{"order": "o-1", "lines": []any{1.0, 2.0}}, raw["payload"].(map[string]any)["value"], "the payload is embedded as JSON")
	require.Equal(t, map[string]any{"event-id": "e-json", "content-type": "application/json"}, raw["metadata"])
	require.Equal(t, "payment declined\nby the gateway", raw["reason"])
	require.Equal(t, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", raw["traceparent"])
	require.Equal(t, []any{}, raw["replays"])
	for _, key := range []string{"id", "consumer_group", "handler", "topic", "message_id", "event_id", "event_type", "state",
		"error_class", "attempts", "times_poisoned", "first_failure_at", "last_failure_at", "poisoned_at", "replayed_at",
		"replay_count", "processed_at", "payload_bytes"} {
		require.Contains(t, raw, key)
	}

	code, out, errOut := cli(t, path, "dlq", "show", strconv.FormatInt(jsonID, 10))
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "payload (29 bytes, JSON):\n  {\n    \"order\": \"o-1\",\n    \"lines\": [\n      1,\n      2\n    ]\n  }\n")
	require.Contains(t, out, "reason:\n  payment declined\n  by the gateway\n")
	require.Contains(t, out, "metadata:\n  content-type: application/json\n  event-id: e-json\n")
	require.Contains(t, out, "replays (0):")

	dec := json.NewDecoder(strings.NewReader(func() string {
		_, out, _ := cli(t, path, "dlq", "show", "--json", strconv.FormatInt(binID, 10))
		return out
	}()))
	require.NoError(t, dec.Decode(&res))
	require.Equal(t, payloadView{Bytes: 5, Encoding: "base64", Value: base64.StdEncoding.EncodeToString(binary)}, res.Payload)
	_, out, _ = cli(t, path, "dlq", "show", strconv.FormatInt(binID, 10), "--hex", "--json")
	res = showResult{}
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.Equal(t, payloadView{Bytes: 5, Encoding: "hex", Value: hex.EncodeToString(binary)}, res.Payload)
	_, out, _ = cli(t, path, "dlq", "show", strconv.FormatInt(binID, 10))
	require.Contains(t, out, "payload (5 bytes, not JSON; shown as base64")
	require.Contains(t, out, "  "+base64.StdEncoding.EncodeToString(binary)+"\n")
	_, out, _ = cli(t, path, "dlq", "show", "--hex", strconv.FormatInt(binID, 10))
	require.Contains(t, out, "shown as a hex dump")
	require.Contains(t, out, "00 ff 10 68 69")

	code, out, errOut = cli(t, path, "dlq", "show", "--json", "--", strconv.FormatInt(binID, 10))
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, `"encoding": "base64"`, "after -- every argument is positional")

	code, _, errOut = cli(t, path, "dlq", "show", "999999")
	require.Equal(t, exitFailed, code)
	require.Equal(t, "millrace dlq show: no poisoned message with id 999999\n", errOut)
}

func TestDLQPurge(t *testing.T) {
	t.Parallel()
	db, schema, path := migrated(t)
	ids := make([]int64, 5)
	for i := range ids {
		group := "billing"
		if i >= 3 {
			group = "shipping"
		}
		ids[i] = insertPoison(t, db, schema, fixture{group: group, handler: group, topic: "orders", eventID: "e-" + strconv.Itoa(i),
			eventType: "OrderCreated", reason: "boom", class: "permanent"})
	}
	_, err := db.Exec(`INSERT INTO "`+schema+`".millrace_poison_replays (poison_id, message_id, replayed_by, times_poisoned) VALUES ($1, 'm', 'op', 1)`, ids[0])
	require.NoError(t, err)
	remaining := func() []int64 {
		var res poisonList
		cliJSON(t, path, &res, "dlq", "list", "--limit", "0")
		got := idsOf(res.Messages)
		for i, j := 0, len(got)-1; i < j; i, j = i+1, j-1 {
			got[i], got[j] = got[j], got[i]
		}
		return got
	}

	var dry struct {
		DryRun     bool                  `json:"dry_run"`
		Selection  string                `json:"selection"`
		WouldPurge []ops.PoisonedMessage `json:"would_purge"`
	}
	cliJSON(t, path, &dry, "dlq", "purge", "--dry-run", "--group", "shipping")
	require.True(t, dry.DryRun)
	require.Equal(t, []int64{ids[3], ids[4]}, idsOf(dry.WouldPurge), "a dry run says what it would purge")
	require.Equal(t, ids, remaining(), "a dry run deletes nothing")
	var res ops.PurgeResult[ops.PoisonedMessage]

	code, _, errOut := cli(t, path, "dlq", "purge", strconv.FormatInt(ids[0], 10), "999999")
	require.Equal(t, exitFailed, code)
	require.Contains(t, errOut, "no poisoned message with id 999999")
	require.Equal(t, ids, remaining(), "an unknown ID purges nothing")

	res = ops.PurgeResult[ops.PoisonedMessage]{}
	cliJSON(t, path, &res, "dlq", "purge", strconv.FormatInt(ids[0], 10))
	require.False(t, res.DryRun)
	require.Equal(t, []int64{ids[0]}, idsOf(res.Purged))
	require.Equal(t, ids[1:], remaining())
	var history int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+schema+`".millrace_poison_replays`).Scan(&history))
	require.Zero(t, history, "the replay history goes with its row")

	code, out, errOut := cli(t, path, "dlq", "purge", "--group", "shipping", "--limit", "1")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "purged 1 message(s)")
	require.Equal(t, []int64{ids[1], ids[2], ids[4]}, remaining(), "--limit takes the oldest first")

	code, _, errOut = cli(t, path, "dlq", "purge")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "choose what to purge")
	require.Equal(t, []int64{ids[1], ids[2], ids[4]}, remaining())

	// --all asks first: no answer (a script) or "no" purges nothing.
	code, _, errOut = cli(t, path, "dlq", "purge", "--all")
	require.Equal(t, exitFailed, code)
	require.Contains(t, errOut, "purge all 3 poisoned message(s) and their replay history for good? [y/N]")
	require.Contains(t, errOut, "not confirmed: nothing was changed")
	var stdout, stderr bytes.Buffer
	require.Equal(t, exitFailed, runIO(context.Background(), []string{"--config", path, "dlq", "purge", "--all"}, strings.NewReader("no\n"), &stdout, &stderr))
	require.Len(t, remaining(), 3)
	stdout.Reset()
	require.Equal(t, exitOK, runIO(context.Background(), []string{"--config", path, "dlq", "purge", "--all"}, strings.NewReader("yes\n"), &stdout, &stderr), stderr.String())
	require.Contains(t, stdout.String(), "purged 3 message(s)")
	require.Empty(t, remaining())
	res = ops.PurgeResult[ops.PoisonedMessage]{}
	cliJSON(t, path, &res, "dlq", "purge", "--all", "--yes")
	require.Equal(t, []ops.PoisonedMessage{}, res.Purged)
}

func TestInboxPurge(t *testing.T) {
	t.Parallel()
	db, schema, path := migrated(t)
	for _, r := range []struct {
		group string
		n     int
		age   time.Duration
	}{{"billing", 3, 48 * time.Hour}, {"billing", 2, time.Minute}, {"audit", 4, 72 * time.Hour}, {"audit", 1, 0}} {
		for i := range r.n {
			_, err := db.Exec(`INSERT INTO "`+schema+`".millrace_inbox (consumer_group, event_id, processed_at)
				VALUES ($1, $2, now() - make_interval(secs => $3))`, r.group, r.group+"-"+r.age.String()+"-"+strconv.Itoa(i), r.age.Seconds())
			require.NoError(t, err)
		}
	}
	count := func(group string) int {
		var n int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+schema+`".millrace_inbox WHERE consumer_group = $1`, group).Scan(&n))
		return n
	}

	var dry struct {
		DryRun      bool     `json:"dry_run"`
		WouldDelete int64    `json:"would_delete"`
		OlderThan   string   `json:"older_than"`
		Group       string   `json:"group"`
		Batch       int      `json:"batch"`
		Warnings    []string `json:"warnings"`
	}
	cliJSON(t, path, &dry, "inbox", "purge", "--older-than", "24h", "--dry-run")
	require.True(t, dry.DryRun)
	require.EqualValues(t, 7, dry.WouldDelete, "a dry run says what it would delete")
	require.Equal(t, 10000, dry.Batch)
	require.Equal(t, []string{"the prune window (24h0m0s) is shorter than consumer.inbox.retention (720h0m0s): a redelivery or replay of an event whose row is deleted is processed again"}, dry.Warnings)
	var res ops.InboxPruneResult
	require.Equal(t, 5, count("billing"))
	require.Equal(t, 5, count("audit"))

	res = ops.InboxPruneResult{}
	cliJSON(t, path, &res, "inbox", "purge", "--older-than", "1d", "--group", "billing", "--batch", "2")
	require.EqualValues(t, 3, res.Deleted, "two batches of at most 2")
	require.Equal(t, "billing", res.Group)
	require.Equal(t, 2, res.Batch)
	require.Equal(t, 2, count("billing"))
	require.Equal(t, 5, count("audit"))

	code, out, errOut := cli(t, path, "inbox", "purge", "--older-than", "24h", "--batch", "3")
	require.Equal(t, exitOK, code, errOut)
	require.Equal(t, "deleted 4 inbox rows of every consumer group processed more than 24h0m0s ago\n", out)
	require.Contains(t, errOut, "warning: the prune window (24h0m0s) is shorter than consumer.inbox.retention")
	require.Equal(t, 2, count("billing"))
	require.Equal(t, 1, count("audit"))

	res = ops.InboxPruneResult{}
	cliJSON(t, path, &res, "inbox", "purge", "--older-than", "800h")
	require.Zero(t, res.Deleted)
	require.Equal(t, []string{}, res.Warnings, "no warning at or beyond the retention")
}

func TestBadArgumentsExitTwoWithUsage(t *testing.T) {
	t.Parallel()
	path := writeConfig(t, "broker:\n  nats:\n    url: nats://127.0.0.1:4222\n")
	cases := []struct {
		args     []string
		message  string // in stderr
		usageFor string // the command whose usage line follows
	}{
		{[]string{"dlq"}, "dlq needs a subcommand: list, groups, show, replay, purge", "dlq"},
		{[]string{"dlq", "lst"}, `unknown command "dlq lst"`, ""},
		{[]string{"dlq", "list", "extra"}, `unexpected arguments ["extra"]`, "dlq list"},
		{[]string{"dlq", "list", "--since", "yesterday"}, `want an RFC 3339 time such as 2025-05-01T12:00:00Z or a duration ago such as 90m, 2h or 7d; got "yesterday"`, "dlq list"},
		{[]string{"dlq", "list", "--until", "-2h"}, `got "-2h"`, "dlq list"},
		{[]string{"dlq", "list", "--replayed", "--not-replayed"}, "--replayed and --not-replayed exclude each other", "dlq list"},
		{[]string{"dlq", "list", "--limit", "-1"}, "--limit must not be negative; got -1", "dlq list"},
		{[]string{"dlq", "list", "--limit", "ten"}, `invalid value "ten" for flag -limit`, "dlq list"},
		{[]string{"dlq", "list", "--nope"}, "flag provided but not defined: -nope", "dlq list"},
		{[]string{"dlq", "show"}, "want exactly one poison message ID; got 0 arguments", "dlq show"},
		{[]string{"dlq", "show", "1", "2"}, "want exactly one poison message ID; got 2 arguments", "dlq show"},
		{[]string{"dlq", "show", "abc"}, `"abc" is not a poison message ID`, "dlq show"},
		{[]string{"dlq", "show", "0"}, `"0" is not a poison message ID`, "dlq show"},
		{[]string{"dlq", "replay"}, "choose what to replay: message IDs, filters", "dlq replay"},
		{[]string{"dlq", "replay", "--dry-run"}, "choose what to replay", "dlq replay"},
		{[]string{"dlq", "replay", "--limit", "5"}, "choose what to replay", "dlq replay"},
		{[]string{"dlq", "replay", "7", "--all"}, "give message IDs, filters or --all, not several of them", "dlq replay"},
		{[]string{"dlq", "replay", "--all", "--topic", "orders"}, "give message IDs, filters or --all, not several of them", "dlq replay"},
		{[]string{"dlq", "replay", "7", "--limit", "1"}, "--limit applies to filters and --all", "dlq replay"},
		{[]string{"dlq", "replay", "7", "x"}, `"x" is not a poison message ID`, "dlq replay"},
		{[]string{"dlq", "purge"}, "choose what to purge", "dlq purge"},
		{[]string{"dlq", "purge", "--all", "--replayed"}, "not several of them", "dlq purge"},
		{[]string{"dlq", "purge", "--since", "2h", "--until"}, "flag needs an argument: -until", "dlq purge"},
		{[]string{"inbox", "purge"}, "--older-than is required", "inbox purge"},
		{[]string{"inbox", "purge", "--older-than", "0s"}, `want a positive duration such as 90m, 720h or 30d; got "0s"`, "inbox purge"},
		{[]string{"inbox", "purge", "--older-than", "-1h"}, `got "-1h"`, "inbox purge"},
		{[]string{"inbox", "purge", "--older-than", "1h", "--batch", "0"}, "--batch must be positive; got 0", "inbox purge"},
		{[]string{"inbox", "purge", "--older-than", "1h", "now"}, `unexpected arguments ["now"]`, "inbox purge"},
		{[]string{"inbox"}, "inbox needs a subcommand: purge", "inbox"},
	}
	for _, c := range cases {
		code, out, errOut := cli(t, path, c.args...)
		require.Equal(t, exitUsage, code, "%v: %s", c.args, errOut)
		require.Empty(t, out, "%v", c.args)
		require.Contains(t, errOut, c.message, "%v", c.args)
		usage := "usage: millrace [--config config.yaml] "
		if c.usageFor != "" {
			usage += c.usageFor + " "
		}
		require.Contains(t, errOut, usage, "%v", c.args)
	}
}

// --help prints to stdout (it is what was asked for) and exits 0.
func TestHelpOnEveryCommand(t *testing.T) {
	t.Parallel()
	require.GreaterOrEqual(t, len(commands), 8)
	for _, c := range commands {
		var out, errOut bytes.Buffer
		args := append(strings.Fields(c.path), "--help")
		require.Equal(t, exitOK, run(context.Background(), args, &out, &errOut), c.path)
		require.Contains(t, out.String(), "usage: millrace [--config config.yaml] "+c.path+" [flags]", c.path)
		require.Contains(t, out.String(), "-json", c.path)
		require.Contains(t, out.String(), c.summary, c.path)
		require.Empty(t, errOut.String(), c.path)
	}
	for _, args := range [][]string{{"dlq", "--help"}, {"--help"}, {"-h"}} {
		var out, errOut bytes.Buffer
		require.Equal(t, exitOK, run(context.Background(), args, &out, &errOut), "%v", args)
		require.Contains(t, out.String(), "dlq replay", "%v", args)
		require.Empty(t, errOut.String(), "%v", args)
	}
	var out, errOut bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"dlq", "--help"}, &out, &errOut))
	require.NotContains(t, out.String(), "inbox purge")
}

// dryReplay is the --json output of a dry-run replay.
type dryReplay struct {
	DryRun      bool                `json:"dry_run"`
	Selection   string              `json:"selection"`
	WouldReplay []ops.ReplayedEntry `json:"would_replay"`
	WouldSkip   []ops.SkippedEntry  `json:"would_skip"`
	WouldWrite  int                 `json:"would_write"`
	Warnings    []string            `json:"warnings"`
}

// A password in a URL is never printed: not in errors, usage or output.
// Not parallel: it sets DATABASE_URL.
func TestSecretsAreNeverPrinted(t *testing.T) {
	const secret = "Sup3r-S3cret"
	path := writeConfig(t, "broker:\n  kind: rabbitmq\n  rabbitmq:\n    url: amqp://guest:"+secret+"@127.0.0.1:1/\n")
	t.Setenv("DATABASE_URL", "postgres://postgres:"+secret+"@127.0.0.1:1/postgres?sslmode=disable&password="+secret)
	for _, args := range [][]string{
		{"dlq", "list"}, {"dlq", "show", "1"}, {"dlq", "replay", "--all"}, {"dlq", "purge", "--all"},
		{"inbox", "purge", "--older-than", "1h"}, {"outbox", "status"}, {"migrate"}, {"relay"},
	} {
		code, out, errOut := cli(t, path, args...)
		require.Equal(t, exitFailed, code, "%v: %s", args, errOut)
		require.NotContains(t, out+errOut, secret, "%v", args)
		c, _ := find(args)
		require.Contains(t, errOut, "millrace "+c.path+": ", "%v", args)
	}
	for _, args := range [][]string{{"dlq", "list", "--help"}, {"dlq", "replay", "--since", "x"}, {"--help"}} {
		_, out, errOut := cli(t, path, args...)
		require.NotContains(t, out+errOut, secret, "%v", args)
	}
	bad := writeConfig(t, "database:\n  url: mysql://root:"+secret+"@db/app\n")
	t.Setenv("DATABASE_URL", "")
	code, out, errOut := cli(t, bad, "dlq", "list")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "database.url")
	require.NotContains(t, out+errOut, secret)
}

func TestDLQReplayWritesTheOutbox(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	schema := testdb.Schema(t, db)
	path := migrateConfig(t, testdb.URL(), schema, "consumer:\n  handlers:\n    guarded: {ordering_guard: true}\n    unguarded: {inbox: {enabled: false}}\n")
	outbox := func() []outboxRow { return readOutbox(t, db, schema) }

	// One event poisoned by two groups, and a message from plain Watermill
	// (no event-id metadata: its UUID is its event id).
	meta := map[string]string{"event-id": "e-1", "event-type": "OrderPlaced", "aggregate-type": "order",
		"aggregate-id": "o-1", "aggregate-version": "3", "occurred-at": "2020-01-02T03:04:05Z", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	guarded := insertPoison(t, db, schema, fixture{group: "guarded", handler: "guarded", topic: "orders", eventID: "e-1",
		eventType: "OrderPlaced", reason: "boom", class: "permanent", payload: []byte(`{"order":"o-1"}`), metadata: meta})
	unguarded := insertPoison(t, db, schema, fixture{group: "unguarded", handler: "unguarded", topic: "orders", eventID: "e-1",
		eventType: "OrderPlaced", reason: "boom", class: "permanent", payload: []byte(`{"order":"o-1"}`), metadata: meta})
	plain := insertPoison(t, db, schema, fixture{group: "guarded", handler: "guarded", topic: "invoices", eventID: "wm-uuid-1",
		eventType: "", reason: "boom", class: "permanent", payload: []byte{1, 2, 3}})
	_, err := db.Exec(`INSERT INTO "` + schema + `".millrace_aggregate_versions (consumer_group, aggregate_type, aggregate_id, version, event_id)
		VALUES ('guarded', 'order', 'o-1', 5, 'e-9')`)
	require.NoError(t, err)

	checkDryReplay(t, path, guarded, unguarded, plain)
	require.Empty(t, outbox(), "a dry run writes nothing")

	code, _, errOut := cli(t, path, "dlq", "replay", strconv.FormatInt(plain, 10), "424242")
	require.Equal(t, exitFailed, code)
	require.Equal(t, "millrace dlq replay: no poisoned message with id 424242\n", errOut)
	require.Empty(t, outbox(), "an unknown ID replays nothing")

	var res ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry]
	cliJSON(t, path, &res, "dlq", "replay", "--topic", "orders")
	require.Len(t, res.Replayed, 2)
	require.Equal(t, 1, res.Messages)
	require.Equal(t, res.Replayed[0].MessageID, res.Replayed[1].MessageID, "both groups' rows are replayed by one message")
	rows := outbox()
	require.Len(t, rows, 1)
	r := rows[0]
	require.Equal(t, "orders", r.dest)
	require.Equal(t, res.Replayed[0].MessageID, r.uuid)
	require.Equal(t, r.uuid, r.msg.UUID)
	require.Equal(t, `{"order":"o-1"}`, string(r.msg.Payload))
	want := message.Metadata{middleware.ReplayOfKey: "e-1", middleware.ReplayGroupsKey: "guarded,unguarded"}
	for k, v := range meta {
		want[k] = v
	}
	require.Equal(t, want, r.msg.Metadata, "the original metadata, event id included, replay-of and replay-groups")

	code, out, errOut := cli(t, path, "dlq", "replay", strconv.FormatInt(plain, 10))
	require.Equal(t, exitOK, code, errOut)
	require.Regexp(t, `^replayed `+strconv.FormatInt(plain, 10)+` \(group guarded, handler guarded, topic invoices, event wm-uuid-1\) as message \S+ for consumer group\(s\) guarded\n`+
		`1 message\(s\) written to the outbox; `, out)
	rows = outbox()
	require.Len(t, rows, 2)
	require.Equal(t, "invoices", rows[1].dest)
	require.Equal(t, []byte{1, 2, 3}, []byte(rows[1].msg.Payload))
	require.Equal(t, message.Metadata{"event-id": "wm-uuid-1", middleware.ReplayOfKey: "wm-uuid-1", middleware.ReplayGroupsKey: "guarded"}, rows[1].msg.Metadata)

	var list poisonList
	cliJSON(t, path, &list, "dlq", "list", "--replayed")
	require.Len(t, list.Messages, 3)
	for _, m := range list.Messages {
		require.Equal(t, ops.PoisonStateReplayed, m.State)
		require.Equal(t, 1, m.ReplayCount)
	}
}

// A replay the relay moved to its quarantine shows in the DLQ as state
// quarantined with the quarantine's row and reason, in dlq list, dlq show
// and the next replay's warning; once that row is replayed the message is
// replayed again.
func TestDLQShowsAReplayTheRelayQuarantined(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, schema, path := migrated(t)
	id := insertPoison(t, db, schema, fixture{group: "billing", handler: "billing", topic: "orders", eventID: "e-1",
		eventType: "OrderPlaced", reason: "boom", class: "permanent", metadata: map[string]string{"event-id": "e-1"}})
	ids := strconv.FormatInt(id, 10)
	var res ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry]
	cliJSON(t, path, &res, "dlq", "replay", ids)
	require.Len(t, res.Replayed, 1)

	// The relay quarantines the replay's outbox row, as it does when the
	// broker refuses it.
	tables := store.Tables{Schema: schema, OutboxTopic: "millrace_outbox"}
	var row store.OutboxRow
	require.NoError(t, db.QueryRow(`SELECT "offset", uuid, payload FROM "`+schema+`".watermill_millrace_outbox`).Scan(&row.Offset, &row.UUID, &row.Payload))
	require.Equal(t, res.Replayed[0].MessageID, row.UUID)
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tables.Quarantine(ctx, tx, row, "orders", "e-1", "nats: size: 2000000 bytes with headers, over the stream's max_msg_size"))
	require.NoError(t, tx.Commit())
	var quarantined ops.List[ops.QuarantinedRow]
	cliJSON(t, path, &quarantined, "quarantine", "list")
	require.Len(t, quarantined.Rows, 1)
	qid := quarantined.Rows[0].ID

	var list poisonList
	cliJSON(t, path, &list, "dlq", "list")
	require.Len(t, list.Messages, 1)
	require.Equal(t, ops.PoisonStateQuarantined, list.Messages[0].State)
	require.NotNil(t, list.Messages[0].ReplayQuarantine)
	require.Equal(t, qid, list.Messages[0].ReplayQuarantine.ID)
	require.Contains(t, list.Messages[0].ReplayQuarantine.Reason, "max_msg_size")
	code, out, errOut := cli(t, path, "dlq", "show", ids)
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "state:           quarantined\n")
	require.Regexp(t, `replay:\s+in the relay quarantine since \S+ as row `+strconv.FormatInt(qid, 10)+`: nats: size: .*max_msg_size \(fix the cause, then `+
		"`millrace quarantine replay "+strconv.FormatInt(qid, 10)+"`"+`\)`, out)
	var dry dryReplay
	cliJSON(t, path, &dry, "dlq", "replay", "--dry-run", ids)
	require.Len(t, dry.Warnings, 1)
	require.Contains(t, dry.Warnings[0], "its last replay is in the relay quarantine as row "+strconv.FormatInt(qid, 10))

	var qres struct {
		DryRun    bool                    `json:"dry_run"`
		Replayed  []ops.QuarantinedRow    `json:"replayed"`
		Skipped   []ops.QuarantineSkipped `json:"skipped"`
		Messages  int                     `json:"messages"`
		Selection string                  `json:"selection"`
		Warnings  []string                `json:"warnings"`
	}
	cliJSON(t, path, &qres, "quarantine", "replay", strconv.FormatInt(qid, 10))
	require.Len(t, qres.Replayed, 1)
	list = poisonList{}
	cliJSON(t, path, &list, "dlq", "list")
	require.Equal(t, ops.PoisonStateReplayed, list.Messages[0].State, "replayed from the quarantine, on its way again")
	require.Nil(t, list.Messages[0].ReplayQuarantine)
}

// outboxRow is a row of the outbox, its envelope read.
type outboxRow struct {
	uuid string
	msg  *message.Message
	dest string
}

// readOutbox reads the outbox of schema in db, in offset order.
func readOutbox(t *testing.T, db *sql.DB, schema string) []outboxRow {
	t.Helper()
	rows, err := db.Query(`SELECT uuid, payload FROM "` + schema + `".watermill_millrace_outbox ORDER BY "offset"`)
	require.NoError(t, err)
	defer rows.Close()
	var out []outboxRow
	for rows.Next() {
		var r outboxRow
		var payload []byte
		require.NoError(t, rows.Scan(&r.uuid, &payload))
		var err error
		r.dest, r.msg, err = envelope.Unwrap(payload)
		require.NoError(t, err)
		out = append(out, r)
	}
	require.NoError(t, rows.Err())
	return out
}

// checkDryReplay checks the dry run of dlq replay --all over the rows of
// TestDLQReplayWritesTheOutbox: their target groups and the warnings.
func checkDryReplay(t *testing.T, path string, guarded, unguarded, plain int64) {
	t.Helper()
	var dry dryReplay
	cliJSON(t, path, &dry, "dlq", "replay", "--all", "--dry-run")
	require.True(t, dry.DryRun)
	require.Equal(t, []int64{guarded, unguarded, plain}, []int64{dry.WouldReplay[0].ID, dry.WouldReplay[1].ID, dry.WouldReplay[2].ID})
	require.Equal(t, [][]string{{"guarded", "unguarded"}, {"guarded", "unguarded"}, {"guarded"}},
		[][]string{dry.WouldReplay[0].TargetGroups, dry.WouldReplay[1].TargetGroups, dry.WouldReplay[2].TargetGroups},
		"a replay is for the groups whose rows of its event it replays")
	require.Equal(t, 2, dry.WouldWrite, "one message per event")
	require.ElementsMatch(t, []string{
		"handler unguarded has consumer.inbox.enabled false: nothing deduplicates its replays, so replaying a message twice processes it twice",
		"message " + strconv.FormatInt(guarded, 10) + ": handler guarded has the ordering guard on and has applied version 5 of order o-1; the event is version 3, so the group drops its replay as stale",
		"event e-1 on topic orders is older than consumer.inbox.retention (720h0m0s): consumer groups that processed it may have pruned it from their inbox and would process it again",
	}, dry.Warnings)
}
