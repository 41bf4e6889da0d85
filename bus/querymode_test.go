package bus_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// queryExecModes are pgx's five ways of running a statement, by the name
// database.url's default_query_exec_mode gives them. Only the first makes
// named prepared statements, which a pooler in transaction mode (PgBouncer
// before 1.21) cannot keep; exec and simple_protocol also encode each
// argument by its Go type instead of by the parameter's type in the
// statement (a []byte is bytea there, whatever the column).
var queryExecModes = []struct {
	name string
	mode pgx.QueryExecMode
}{
	{"cache_statement", pgx.QueryExecModeCacheStatement},
	{"cache_describe", pgx.QueryExecModeCacheDescribe},
	{"describe_exec", pgx.QueryExecModeDescribeExec},
	{"exec", pgx.QueryExecModeExec},
	{"simple_protocol", pgx.QueryExecModeSimpleProtocol},
}

// Every statement millrace runs works in every query exec mode, through
// database/sql (the mode in the URL) and through pgx (a pool whose config
// sets it), and what Publish accepts arrives byte for byte: one whole flow
// per mode and API, through the relay and NATS to a handler with the inbox
// and the ordering guard, then the poison table and its replay, scheduled
// events, a saga, the relay quarantine and the operations API.
func TestEveryStatementInEveryQueryExecMode(t *testing.T) {
	t.Parallel()
	for _, m := range queryExecModes {
		for _, api := range []string{"database_sql", "pgx"} {
			t.Run(m.name+"/"+api, func(t *testing.T) {
				t.Parallel()
				f := startModeFlow(t, m.name, m.mode, api == "pgx")
				f.publishAndConsume()
				f.staleVersion()
				f.poisonAndReplay()
				f.scheduleAndCancel()
				f.sagaSteps()
				f.quarantineAndReplay()
				f.statusAndPrune()
			})
		}
	}
}

// modeFlow is one mode's flow: a Bus in that mode, its handlers running.
type modeFlow struct {
	t    *testing.T
	ctx  context.Context
	mode string
	cfg  bus.Config
	// witness reads and writes what the test checks in the default mode.
	witness *sql.DB
	// pool is the pgx pool a Bus was opened on; nil for a *sql.DB.
	pool   *pgxpool.Pool
	b      *bus.Bus
	ops    *ops.Client
	reg    *prometheus.Registry
	suffix string
	// topic is consumed by handler (its consumer group too, with the
	// ordering guard) and by batched (with batches of inbox transactions).
	topic, handler, batched string
	sagaTopic, sagaGroup    string
	// sagaFailed is set once the saga's first step has failed on purpose.
	sagaFailed atomic.Bool
	errors     *errorLog
	notes      *bus.Topic[modeNote]
	sagaEvents *bus.Topic[modeSagaEvent]
	// broken makes handler fail the events of poisonedAggregate.
	broken atomic.Bool
	mu     sync.Mutex
	got    map[string]bus.Event // by event id, as handler last got it
}

// modeNote is a typed event on the flow's topic.
type modeNote struct {
	ID   string `json:"id"`
	Text string `json:"text"`
}

func (modeNote) EventType() string                  { return "ModeNote" }
func (n modeNote) Aggregate() (string, string)      { return "note", n.ID }
func (modeSagaEvent) EventType() string             { return "ModeSagaEvent" }
func (e modeSagaEvent) Aggregate() (string, string) { return "order", e.OrderID }

// modeSagaEvent starts the flow's saga, and completes it the second time.
type modeSagaEvent struct {
	OrderID string `json:"order_id"`
	Note    string `json:"note"`
}

// modeSagaState is the flow's saga state.
type modeSagaState struct {
	Notes []string `json:"notes"`
}

// The aggregates whose events handler (while broken) and batched fail.
const (
	poisonedAggregate = "o-poison"
	binaryAggregate   = "o-binary"
)

// awkwardText is what breaks a statement that quotes, escapes or re-encodes.
const awkwardText = "Zoë's \"quoted\" back\\slash \\x41 $1 $$ ☃ 🚀 '); DROP TABLE x; --"

// withQueryExecMode is raw with default_query_exec_mode set to mode.
func withQueryExecMode(t *testing.T, raw, mode string) string {
	u, err := url.Parse(raw)
	require.NoError(t, err)
	q := u.Query()
	q.Set("default_query_exec_mode", mode)
	u.RawQuery = q.Encode()
	return u.String()
}

func startModeFlow(t *testing.T, modeName string, mode pgx.QueryExecMode, viaPgx bool) *modeFlow {
	ctx := context.Background()
	witness := testdb.Open(t)
	schema := testdb.Schema(t, witness)
	suffix := schema[len(schema)-8:]
	f := &modeFlow{t: t, ctx: ctx, mode: modeName, witness: witness, reg: prometheus.NewRegistry(), suffix: suffix,
		topic: "modes-" + suffix, handler: "modes-h-" + suffix, batched: "modes-b-" + suffix,
		sagaTopic: "modes-saga-" + suffix, sagaGroup: "modes-s-" + suffix, errors: &errorLog{}, got: map[string]bus.Event{}}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("errors logged by the Bus:\n%s", f.errors)
		}
	})
	f.cfg.Database.Schema = schema
	f.cfg.Consumer.Inbox.CleanupInterval = 100 * time.Millisecond // the retention loops run their statements too
	f.cfg.Consumer.Handlers = map[string]middleware.Config{
		f.handler: {OrderingGuard: new(true)},
		f.batched: {Batch: middleware.BatchConfig{MaxMessages: 8, MaxWait: 50 * time.Millisecond}},
	}
	brokertest.Apply(t, bus.KindNATS, &f.cfg)
	brokertest.Cleanup(t, bus.KindNATS, f.topic, f.handler, f.batched)
	brokertest.Cleanup(t, bus.KindNATS, f.sagaTopic, f.sagaGroup)
	f.notes = bus.Must(bus.NewTopic[modeNote](f.topic))
	f.sagaEvents = bus.Must(bus.NewTopic[modeSagaEvent](f.sagaTopic))
	_, err := witness.Exec(`CREATE TABLE "` + schema + `".effects (grp text NOT NULL, event_id text NOT NULL, note text NOT NULL)`)
	require.NoError(t, err)
	opts := []bus.Option{bus.WithRegistry(f.reg), bus.WithLogger(slog.New(f.errors))}

	if viaPgx {
		pcfg, err := pgxpool.ParseConfig(testdb.URL())
		require.NoError(t, err)
		pcfg.ConnConfig.DefaultQueryExecMode = mode
		f.pool, err = pgxpool.NewWithConfig(ctx, pcfg)
		require.NoError(t, err)
		t.Cleanup(f.pool.Close)
		require.NoError(t, bus.Migrate(ctx, f.pool, f.cfg))
		f.b, err = bus.Open(ctx, f.cfg, f.pool, opts...)
		require.NoError(t, err)
	} else {
		db, err := sql.Open("pgx", withQueryExecMode(t, testdb.URL(), modeName))
		require.NoError(t, err)
		t.Cleanup(func() { db.Close() })
		require.NoError(t, bus.Migrate(ctx, db, f.cfg))
		f.b, err = bus.Open(ctx, f.cfg, db, opts...)
		require.NoError(t, err)
	}
	t.Cleanup(func() { f.b.Close() })
	f.checkModeInEffect()
	f.ops, err = ops.New(ctx, f.b.DB(), f.cfg)
	require.NoError(t, err)
	require.NoError(t, f.b.Handle(f.topic, f.handler, f.handle(f.handler)))
	require.NoError(t, f.b.Handle(f.topic, f.batched, f.handle(f.batched)))
	require.NoError(t, f.saga().Handle(f.b, f.sagaGroup))
	f.run()
	return f
}

// checkModeInEffect proves that the Bus's connections run in the mode:
// only cache_statement prepares a named statement (this query itself,
// before it runs) for a query with arguments.
func (f *modeFlow) checkModeInEffect() {
	const q = `SELECT count(*) FROM pg_prepared_statements WHERE $1::int = 1`
	prepares := f.mode == "cache_statement"
	var named int
	require.NoError(f.t, f.b.DB().QueryRowContext(f.ctx, q, 1).Scan(&named))
	require.Equal(f.t, prepares, named > 0, "named prepared statements on the Bus's database/sql connection in mode %s", f.mode)
	if f.pool != nil {
		require.NoError(f.t, f.pool.QueryRow(f.ctx, q, 1).Scan(&named))
		require.Equal(f.t, prepares, named > 0, "named prepared statements on the pool's connection in mode %s", f.mode)
	}
}

// run runs the Bus until the test ends.
func (f *modeFlow) run() {
	runCtx, stop := context.WithCancel(f.ctx)
	done := make(chan error, 1)
	go func() { done <- f.b.Run(runCtx) }()
	f.t.Cleanup(func() {
		stop()
		select {
		case err := <-done:
			if !f.t.Failed() { // else Run may have been stopped while it started
				require.NoError(f.t, err)
			}
		case <-time.After(60 * time.Second):
			f.t.Error("Run did not return after its context was cancelled")
		}
	})
}

// handle is the flow's handler for group: it writes its effect in its
// inbox transaction. handler fails the events of poisonedAggregate while
// broken, batched those of binaryAggregate.
func (f *modeFlow) handle(group string) bus.HandlerFunc {
	return func(ctx context.Context, ev bus.Event) error {
		switch {
		case group == f.handler && ev.AggregateID == poisonedAggregate && f.broken.Load():
			return bus.Permanent(errors.New("cannot take it yet: " + awkwardText))
		case group == f.batched && ev.AggregateID == binaryAggregate:
			return bus.Permanent(errors.New("batched: " + awkwardText))
		}
		insert := `INSERT INTO "` + f.cfg.Database.Schema + `".effects VALUES ($1, $2, $3)`
		var err error
		if f.pool != nil {
			_, err = bus.Tx[pgx.Tx](ctx).Exec(ctx, insert, group, ev.ID, ev.Metadata["note"])
		} else {
			_, err = bus.Tx[*sql.Tx](ctx).ExecContext(ctx, insert, group, ev.ID, ev.Metadata["note"])
		}
		if err != nil || group != f.handler {
			return err
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		f.got[ev.ID] = ev
		return nil
	}
}

// errorLog is a slog handler that keeps the messages of errors.
type errorLog struct {
	mu       sync.Mutex
	messages []string
}

func (l *errorLog) Enabled(_ context.Context, level slog.Level) bool { return level >= slog.LevelError }

func (l *errorLog) Handle(_ context.Context, r slog.Record) error {
	msg := r.Message
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "error" || a.Key == "err" {
			msg += ": " + a.Value.String()
		}
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.messages = append(l.messages, msg)
	return nil
}

func (l *errorLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.messages, "\n")
}

func (l *errorLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *errorLog) WithGroup(string) slog.Handler      { return l }

// requireOnly checks that every error logged so far is one the flow
// causes on purpose (containing one of expected): a relay, scheduler,
// retention loop or consumer whose statement failed in the mode would have
// logged it.
func (l *errorLog) requireOnly(t *testing.T, expected ...string) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, msg := range l.messages {
		ok := false
		for _, e := range expected {
			ok = ok || strings.Contains(msg, e)
		}
		require.True(t, ok, "unexpected error logged: %s", msg)
	}
}

// inTx runs fn in a transaction of the flow's API and commits it.
func (f *modeFlow) inTx(fn func(sqlTx *sql.Tx, pgxTx pgx.Tx) error) {
	f.t.Helper()
	if f.pool != nil {
		tx, err := f.pool.Begin(f.ctx)
		require.NoError(f.t, err)
		defer tx.Rollback(f.ctx) //nolint:errcheck // a no-op after Commit
		require.NoError(f.t, fn(nil, tx))
		require.NoError(f.t, tx.Commit(f.ctx))
		return
	}
	tx, err := f.b.DB().BeginTx(f.ctx, nil)
	require.NoError(f.t, err)
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	require.NoError(f.t, fn(tx, nil))
	require.NoError(f.t, tx.Commit())
}

// publish publishes events through the flow's API.
func (f *modeFlow) publish(events ...bus.Event) {
	f.t.Helper()
	f.inTx(func(sqlTx *sql.Tx, pgxTx pgx.Tx) error {
		if pgxTx != nil {
			return f.b.Publish(f.ctx, bus.Pgx(pgxTx), f.topic, events...)
		}
		return f.b.Publish(f.ctx, sqlTx, f.topic, events...)
	})
}

// awkwardEvent is an event with id, payload and metadata that quoting,
// escaping or re-encoding would change.
func (f *modeFlow) awkwardEvent(n, aggregateID string, contentType string, payload []byte) bus.Event {
	return bus.Event{
		ID: "évt-" + n + `-'q"\` + f.suffix, Type: "Awkward", AggregateType: "order", AggregateID: aggregateID,
		AggregateVersion: 1, ContentType: contentType, Payload: payload,
		CorrelationID: `corr-"` + n + `"`, OccurredAt: time.Date(2026, 5, 6, 7, 8, 9, 123456789, time.UTC),
		Metadata: map[string]string{
			"note":  awkwardText + " " + n,
			"json":  `{"a":[1,"two",null],"b":"\u00e9\\"}`,
			"bytea": `\x7b7d`,
			"empty": "",
			"lines": "one\ntwo\r\n\ttabbed",
		},
	}
}

// requireArrived waits until handler has committed each event once, and
// checks that it got each byte for byte.
func (f *modeFlow) requireArrived(events ...bus.Event) {
	f.t.Helper()
	for _, sent := range events {
		testkit.Eventually(f.t, 90*time.Second, "event "+sent.ID+" is processed", func() bool {
			return f.effects(f.handler, sent.ID) == 1
		})
		f.mu.Lock()
		got := f.got[sent.ID]
		f.mu.Unlock()
		f.requireSame(sent, got)
	}
}

// requireSame checks that got is sent as it arrived: the envelope fields,
// the payload's bytes and every metadata entry.
func (f *modeFlow) requireSame(sent, got bus.Event) {
	f.t.Helper()
	require.Equal(f.t, sent.ID, got.ID)
	require.True(f.t, bytes.Equal(sent.Payload, got.Payload), "payload of %s: sent %q, got %q", sent.ID, sent.Payload, got.Payload)
	require.Equal(f.t, sent.Type, got.Type)
	require.Equal(f.t, sent.AggregateType, got.AggregateType)
	require.Equal(f.t, sent.AggregateID, got.AggregateID)
	require.Equal(f.t, sent.AggregateVersion, got.AggregateVersion)
	require.Equal(f.t, sent.CorrelationID, got.CorrelationID)
	require.True(f.t, sent.OccurredAt.Equal(got.OccurredAt), "occurred-at of %s: sent %s, got %s", sent.ID, sent.OccurredAt, got.OccurredAt)
	if sent.ContentType != "" {
		require.Equal(f.t, sent.ContentType, got.ContentType)
	}
	for k, v := range sent.Metadata {
		require.Equal(f.t, v, got.Metadata[k], "metadata %q of %s", k, sent.ID)
	}
}

// effects counts the committed effects of eventID in group.
func (f *modeFlow) effects(group, eventID string) int {
	var n int
	require.NoError(f.t, f.witness.QueryRow(`SELECT count(*) FROM "`+f.cfg.Database.Schema+`".effects WHERE grp = $1 AND event_id = $2`,
		group, eventID).Scan(&n))
	return n
}

// publishAndConsume publishes awkward events through every publishing door
// of the flow's API, and the handler gets each once, byte for byte.
func (f *modeFlow) publishAndConsume() {
	octets := "application/octet-stream"
	events := []bus.Event{
		f.awkwardEvent("json", "o-json", "", []byte(`{"text":"Zoë \"quoted\" back\\slash \\x41 \u0000 ☃","n":[1,2.5e3,null,true]}`)),
		f.awkwardEvent("empty", "o-empty", octets, []byte{}),
		f.awkwardEvent("binary", binaryAggregate, octets, []byte{0, 0xff, '\\', 'x', '\'', 0xc3, '"', '$', '1'}),
		f.awkwardEvent("bytea-looking", "o-bytea", "", []byte(`"\\x7b7d"`)),
		f.awkwardEvent("json-looking", "o-jsonish", "text/plain; charset=utf-8", []byte(`{"not":"checked", "spaced" : [ 1 ]}`)),
	}
	note := modeNote{ID: "n-" + f.suffix, Text: awkwardText}
	f.publish(events[:2]...)
	if f.pool != nil {
		f.publish(events[2:4]...)
		f.inTx(func(_ *sql.Tx, tx pgx.Tx) error { return f.notes.Publish(f.ctx, f.b, bus.Pgx(tx), note) })
	} else {
		require.NoError(f.t, f.b.PublishInOwnTx(f.ctx, f.topic, events[2:4]...))
		f.inTx(func(tx *sql.Tx, _ pgx.Tx) error { return f.notes.Publish(f.ctx, f.b, tx, note) })
	}
	f.publish(events[4])
	f.requireArrived(events...)

	var typed bus.Event
	testkit.Eventually(f.t, 90*time.Second, "the typed event is processed", func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		for _, ev := range f.got {
			if ev.Type == "ModeNote" {
				typed = ev
				return true
			}
		}
		return false
	})
	var value modeNote
	require.NoError(f.t, json.Unmarshal(typed.Payload, &value))
	require.Equal(f.t, note, value)
	// The handler saw it before its inbox transaction committed the effect.
	testkit.Eventually(f.t, 90*time.Second, "the typed event's effect is committed", func() bool {
		return f.effects(f.handler, typed.ID) == 1
	})
	f.requireBatched(events)
}

// requireBatched checks the batched group's share of events: every one
// committed once, but the binary one, poisoned with its bytes intact.
func (f *modeFlow) requireBatched(events []bus.Event) {
	var list ops.List[ops.PoisonedMessage]
	testkit.Eventually(f.t, 90*time.Second, "batched poisons the binary event", func() bool {
		var err error
		list, err = f.ops.DLQ().List(f.ctx, ops.Filter{Handler: f.batched}, 0)
		require.NoError(f.t, err)
		return len(list.Rows) == 1
	})
	detail, err := f.ops.DLQ().Get(f.ctx, list.Rows[0].ID)
	require.NoError(f.t, err)
	require.Equal(f.t, "batched: "+awkwardText, detail.Reason)
	for _, ev := range events {
		if ev.AggregateID != binaryAggregate {
			testkit.Eventually(f.t, 90*time.Second, "batched commits "+ev.ID, func() bool { return f.effects(f.batched, ev.ID) == 1 })
			continue
		}
		require.Equal(f.t, ev.ID, detail.EventID)
		require.True(f.t, bytes.Equal(ev.Payload, detail.Payload), "poisoned payload: sent %q, stored %q", ev.Payload, detail.Payload)
		require.Zero(f.t, f.effects(f.batched, ev.ID))
	}
}

// staleVersion publishes an older version of an aggregate under a new
// event id: the ordering guard drops it.
func (f *modeFlow) staleVersion() {
	stale := f.awkwardEvent("stale", "o-json", "", []byte(`{"stale":true}`))
	f.publish(stale)
	testkit.Eventually(f.t, 90*time.Second, "the stale event is acked", func() bool {
		return f.outcomes(middleware.OutcomeStale) == 1
	})
	require.Zero(f.t, f.effects(f.handler, stale.ID), "the stale event had no effect")
}

// outcomes reads millrace_consumer_messages_total of the handler.
func (f *modeFlow) outcomes(outcome string) float64 {
	return testkit.Metric(f.t, f.reg, middleware.MetricMessages, map[string]string{"handler": f.handler, "outcome": outcome})
}

// poisonAndReplay poisons an event, finds it through every listing of the
// operations API with its payload and metadata intact, replays it once the
// handler is fixed, and purges it.
func (f *modeFlow) poisonAndReplay() {
	f.broken.Store(true)
	sent := f.awkwardEvent("poison", poisonedAggregate, "", []byte(`{"poison":"Zoë \"q\" \\ \u2603"}`))
	f.publish(sent)
	filter := ops.Filter{Topic: f.topic, Handler: f.handler, Group: f.handler, Reason: `"QUOTED" BACK\SLASH`,
		Since: ops.Ago(time.Hour), Until: ops.At(time.Now().Add(time.Hour))}
	var list ops.List[ops.PoisonedMessage]
	testkit.Eventually(f.t, 90*time.Second, "the event is poisoned", func() bool {
		var err error
		list, err = f.ops.DLQ().List(f.ctx, filter, 10)
		require.NoError(f.t, err)
		return len(list.Rows) == 1
	})
	row := list.Rows[0]
	require.Equal(f.t, sent.ID, row.EventID)
	require.Equal(f.t, "cannot take it yet: "+awkwardText, row.Reason)
	require.Equal(f.t, ops.PoisonStatePoisoned, row.State)
	groups, err := f.ops.PoisonGroups(f.ctx, ops.Filter{Fingerprint: row.Fingerprint})
	require.NoError(f.t, err)
	require.Len(f.t, groups, 1)
	require.EqualValues(f.t, 1, groups[0].Messages)
	detail, err := f.ops.DLQ().Get(f.ctx, row.ID)
	require.NoError(f.t, err)
	require.True(f.t, bytes.Equal(sent.Payload, detail.Payload), "poisoned payload: sent %q, stored %q", sent.Payload, detail.Payload)
	for k, v := range sent.Metadata {
		require.Equal(f.t, v, detail.Metadata[k], "poisoned metadata %q", k)
	}

	f.broken.Store(false)
	sel := ops.Selection{IDs: []int64{row.ID}}
	dry, err := f.ops.DLQ().Replay(f.ctx, sel, ops.ReplayOptions{DryRun: true})
	require.NoError(f.t, err)
	sel.Expect = dry.Selection
	res, err := f.ops.DLQ().Replay(f.ctx, sel, ops.ReplayOptions{By: `op "ü" \ `})
	require.NoError(f.t, err)
	require.Len(f.t, res.Replayed, 1)
	f.requireArrived(sent)
	f.mu.Lock()
	require.Equal(f.t, row.MessageID, f.got[sent.ID].Metadata[middleware.ReplayOfKey])
	f.mu.Unlock()
	detail, err = f.ops.DLQ().Get(f.ctx, row.ID)
	require.NoError(f.t, err)
	require.Equal(f.t, ops.PoisonStateProcessed, detail.State)
	require.Len(f.t, detail.Replays, 1)
	require.Equal(f.t, `op "ü" \ `, detail.Replays[0].ReplayedBy)

	// Replayed again by force: the inbox acks the duplicate.
	sel.Expect = ""
	res, err = f.ops.DLQ().Replay(f.ctx, sel, ops.ReplayOptions{Force: true})
	require.NoError(f.t, err)
	require.Len(f.t, res.Replayed, 1)
	testkit.Eventually(f.t, 90*time.Second, "the duplicate is acked", func() bool {
		return f.outcomes(middleware.OutcomeDuplicate) == 1
	})
	require.Equal(f.t, 1, f.effects(f.handler, sent.ID), "the duplicate had no effect")

	purgeReviewed(f, f.ops.DLQ(), ops.Selection{Filter: ops.Filter{Handler: f.handler}}, 1)
	list, err = f.ops.DLQ().List(f.ctx, ops.Filter{}, 0)
	require.NoError(f.t, err)
	require.Len(f.t, list.Rows, 1, "batched's poisoned event is left")
	require.Equal(f.t, f.batched, list.Rows[0].Handler)
}

// schedule schedules events through the flow's API.
func (f *modeFlow) schedule(when bus.When, events ...bus.Event) []string {
	f.t.Helper()
	var ids []string
	f.inTx(func(sqlTx *sql.Tx, pgxTx pgx.Tx) (err error) {
		if pgxTx != nil {
			ids, err = f.b.Schedule(f.ctx, bus.Pgx(pgxTx), f.topic, when, events...)
		} else {
			ids, err = f.b.Schedule(f.ctx, sqlTx, f.topic, when, events...)
		}
		return err
	})
	return ids
}

// scheduleAndCancel schedules an event due already (the relay moves it into
// the outbox; it arrives byte for byte), one due in an hour (cancelled in a
// transaction of the flow's API) and one due at an odd instant in another
// zone (listed at that instant, cancelled through the operations API).
func (f *modeFlow) scheduleAndCancel() {
	due := f.awkwardEvent("due", "o-due", "", []byte(`{"due":"now \"ü\""}`))
	later := f.awkwardEvent("later", "o-later", "", []byte(`{}`))
	odd := f.awkwardEvent("odd", "o-odd", "", []byte(`{}`))
	at := time.Date(2999, 1, 2, 3, 4, 5, 123456789, time.FixedZone("UTC+5:30", 5*3600+1800))
	f.schedule(bus.DueAt(time.Now().Add(-time.Minute)), due)
	f.schedule(bus.DueIn(time.Hour), later)
	f.schedule(bus.DueAt(at), odd)
	f.requireArrived(due)

	events, err := f.ops.ScheduledEvents(f.ctx, later.ID, odd.ID, due.ID)
	require.NoError(f.t, err)
	require.Len(f.t, events, 2, "the due event left the scheduled table")
	require.Equal(f.t, later.ID, events[0].ID)
	require.Equal(f.t, odd.ID, events[1].ID)
	require.Equal(f.t, later.AggregateID, events[0].AggregateID)
	require.True(f.t, at.Truncate(time.Microsecond).Equal(events[1].DueAt), "due at %s, listed at %s", at, events[1].DueAt)
	f.inTx(func(sqlTx *sql.Tx, pgxTx pgx.Tx) error {
		if pgxTx != nil {
			return f.b.CancelScheduled(f.ctx, bus.Pgx(pgxTx), later.ID)
		}
		return f.b.CancelScheduled(f.ctx, sqlTx, later.ID)
	})
	require.NoError(f.t, f.ops.CancelScheduled(f.ctx, odd.ID))
	list, err := f.ops.ListScheduled(f.ctx, 0)
	require.NoError(f.t, err)
	require.Empty(f.t, list.Events)
	require.Zero(f.t, list.Total)
}

// saga is the flow's saga: its first event starts it (it schedules a
// timeout and sends a command to the flow's topic, in its transaction), the
// second completes it (which cancels the timeout).
func (f *modeFlow) saga() *bus.Saga[modeSagaState] {
	s := bus.NewSaga[modeSagaState]("mode_saga")
	bus.StartWith(s, f.sagaEvents, func(m bus.Message[modeSagaEvent]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[modeSagaState], m bus.Message[modeSagaEvent]) error {
			if sc.New && !f.sagaFailed.Swap(true) {
				return errors.New("the saga's first step fails once: " + awkwardText)
			}
			sc.State.Notes = append(sc.State.Notes, m.Value.Note)
			if !sc.New {
				sc.Complete()
				return nil
			}
			late, err := f.sagaEvents.Event(modeSagaEvent{OrderID: sc.ID, Note: "late"})
			if err != nil {
				return err
			}
			if err := sc.ScheduleTimeout(ctx, "late", f.sagaTopic, bus.DueIn(time.Hour), late); err != nil {
				return err
			}
			command := f.awkwardEvent("command", "o-saga", "", []byte(`{"from":"saga"}`))
			if f.pool != nil {
				return f.b.Publish(ctx, bus.Tx[bus.Execer](ctx), f.topic, command)
			}
			return f.b.Publish(ctx, bus.Tx[bus.Execer](ctx), f.topic, command)
		})
	return s
}

// publishSagaEvent publishes a saga event through the flow's API.
func (f *modeFlow) publishSagaEvent(v modeSagaEvent) {
	f.inTx(func(sqlTx *sql.Tx, pgxTx pgx.Tx) error {
		if pgxTx != nil {
			return f.sagaEvents.Publish(f.ctx, f.b, bus.Pgx(pgxTx), v)
		}
		return f.sagaEvents.Publish(f.ctx, f.b, sqlTx, v)
	})
}

// sagaSteps runs both steps of the flow's saga and reads it through the
// operations API after each.
func (f *modeFlow) sagaSteps() {
	id := `saga-"ü"\` + f.suffix
	f.publishSagaEvent(modeSagaEvent{OrderID: id, Note: awkwardText})
	f.requireArrived(f.awkwardEvent("command", "o-saga", "", []byte(`{"from":"saga"}`)))
	inst, err := f.ops.Saga(f.ctx, "mode_saga", id)
	require.NoError(f.t, err)
	var state modeSagaState
	require.NoError(f.t, json.Unmarshal(inst.State, &state))
	require.Equal(f.t, []string{awkwardText}, state.Notes)
	require.Nil(f.t, inst.CompletedAt)
	require.NotNil(f.t, inst.LastError, "the failed attempt is recorded")
	require.Equal(f.t, "the saga's first step fails once: "+awkwardText, inst.LastError.Error)
	require.False(f.t, inst.LastError.Current, "the retry committed")
	timeout := inst.Timeouts["late"]
	scheduled, err := f.ops.ScheduledEvents(f.ctx, timeout)
	require.NoError(f.t, err)
	require.Len(f.t, scheduled, 1, "the saga's timeout is scheduled")

	f.publishSagaEvent(modeSagaEvent{OrderID: id, Note: "done"})
	testkit.Eventually(f.t, 90*time.Second, "the saga completes", func() bool {
		inst, err = f.ops.Saga(f.ctx, "mode_saga", id)
		require.NoError(f.t, err)
		return inst.CompletedAt != nil
	})
	require.NoError(f.t, json.Unmarshal(inst.State, &state))
	require.Equal(f.t, []string{awkwardText, "done"}, state.Notes)
	require.EqualValues(f.t, 2, inst.Version)
	scheduled, err = f.ops.ScheduledEvents(f.ctx, timeout)
	require.NoError(f.t, err)
	require.Empty(f.t, scheduled, "completing the saga cancelled its timeout")
	list, err := f.ops.ListSagas(f.ctx, ops.SagaFilter{Saga: "mode_saga", Completed: true}, 10)
	require.NoError(f.t, err)
	require.Len(f.t, list.Instances, 1)
}

// quarantineAndReplay has the relay quarantine a row the broker refuses
// (written as plain SQL, as another writer could), reads it back byte for
// byte, replays it with Force (quarantined again) and purges both.
func (f *modeFlow) quarantineAndReplay() {
	msg := message.NewMessage("refused-"+f.suffix, []byte(`{"refused":"ü \"q\" \\"}`))
	msg.Metadata.Set("bad:key", awkwardText)
	env, err := envelope.Wrap(f.topic, msg)
	require.NoError(f.t, err)
	_, err = f.witness.Exec(`INSERT INTO "`+f.cfg.Database.Schema+`".watermill_millrace_outbox (uuid, payload, metadata, transaction_id)
		VALUES ($1, $2, '{}', pg_current_xact_id())`, msg.UUID, string(env))
	require.NoError(f.t, err)
	filter := ops.Filter{Topic: f.topic, Reason: "BAD:KEY", Since: ops.Ago(time.Hour)}
	var list ops.List[ops.QuarantinedRow]
	testkit.Eventually(f.t, 90*time.Second, "the relay quarantines the refused row", func() bool {
		list, err = f.ops.Quarantine().List(f.ctx, filter, 10)
		require.NoError(f.t, err)
		return len(list.Rows) == 1
	})
	row := list.Rows[0]
	require.Equal(f.t, msg.UUID, row.EventID)
	detail, err := f.ops.Quarantine().Get(f.ctx, row.ID)
	require.NoError(f.t, err)
	require.True(f.t, bytes.Equal(env, detail.Envelope), "quarantined envelope: wrote %q, stored %q", env, detail.Envelope)
	require.Equal(f.t, awkwardText, detail.Metadata["bad:key"])

	res, err := f.ops.Quarantine().Replay(f.ctx, ops.Selection{IDs: []int64{row.ID}}, ops.ReplayOptions{Force: true})
	require.NoError(f.t, err)
	require.Len(f.t, res.Replayed, 1)
	testkit.Eventually(f.t, 90*time.Second, "the relay quarantines the replayed row again", func() bool {
		list, err = f.ops.Quarantine().List(f.ctx, filter, 10)
		require.NoError(f.t, err)
		return len(list.Rows) == 2
	})
	detail, err = f.ops.Quarantine().Get(f.ctx, list.Rows[0].ID)
	require.NoError(f.t, err)
	require.True(f.t, bytes.Equal(env, detail.Envelope), "replayed envelope: wrote %q, stored %q", env, detail.Envelope)
	purgeReviewed(f, f.ops.Quarantine(), ops.Selection{All: true}, 2)
}

// purgeReviewed purges sel from table as an operator does: a dry run that
// must select want rows, then the purge of what it showed.
func purgeReviewed[R, D, E, S any](f *modeFlow, table ops.Table[R, D, E, S], sel ops.Selection, want int) {
	would, err := table.Purge(f.ctx, sel, true)
	require.NoError(f.t, err)
	require.Len(f.t, would.Purged, want)
	sel.Expect = would.Selection
	_, err = table.Purge(f.ctx, sel, false)
	require.NoError(f.t, err)
}

// statusAndPrune reads the outbox status once the relay is done, and
// prunes the handler's inbox.
func (f *modeFlow) statusAndPrune() {
	var st ops.OutboxStatus
	testkit.Eventually(f.t, 90*time.Second, "the relay forwarded every row", func() bool {
		var err error
		st, err = f.ops.OutboxStatus(f.ctx, "")
		require.NoError(f.t, err)
		return st.Pending == 0
	})
	require.Zero(f.t, st.Quarantined)
	require.Positive(f.t, st.Forwarded)
	require.False(f.t, st.LastForwardedAt.IsZero())
	all, err := f.ops.OutboxStatuses(f.ctx)
	require.NoError(f.t, err)
	require.Len(f.t, all, 1)

	rows, err := f.ops.InboxRows(f.ctx)
	require.NoError(f.t, err)
	f.mu.Lock()
	processed := int64(len(f.got)) + 1 // the stale event's id is in the inbox too
	f.mu.Unlock()
	require.Equal(f.t, processed, rows[f.handler])
	prune := ops.InboxPrune{OlderThan: time.Microsecond, Group: f.handler, Batch: 3, DryRun: true}
	res, err := f.ops.PruneInbox(f.ctx, prune)
	require.NoError(f.t, err)
	require.Equal(f.t, processed, res.Deleted)
	prune.DryRun = false
	res, err = f.ops.PruneInbox(f.ctx, prune)
	require.NoError(f.t, err)
	require.Equal(f.t, processed, res.Deleted)
	rows, err = f.ops.InboxRows(f.ctx)
	require.NoError(f.t, err)
	require.Zero(f.t, rows[f.handler])
	f.errors.requireOnly(f.t, "Message poisoned", "Outbox row moved to the relay quarantine", "the saga's first step fails once")
}
