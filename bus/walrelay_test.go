package bus_test

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/forwarder/wal"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testlog"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// walWait bounds every wait of the WAL relay tests: it only catches a hang.
const walWait = 15 * time.Second

// TestWALRelay runs services with relay.source: wal on a private
// PostgreSQL with wal_level = logical (the shared one stays at replica),
// each subtest with a schema, slot and topic of its own, on NATS and on
// Kafka, and with outbox.mode: wal_messages on RabbitMQ too: events
// reach the consumer once each, in commit order and byte for byte, unheld
// by an open transaction, across a relay restart, and a row the broker
// refuses goes to the quarantine.
func TestWALRelay(t *testing.T) {
	t.Parallel()
	tests := map[string]func(*testing.T, *walRig){
		"CommitOrder": testWALCommitOrder,
		"Restart":     testWALRestart,
		"Scheduled":   testWALScheduled,
		"Bytes":       testWALBytes,
		"Shards":      testWALShards,
	}
	kinds := map[string][]string{bus.OutboxModeTable: {bus.KindNATS, bus.KindKafka}, bus.OutboxModeWALMessages: brokertest.Kinds}
	// A server per mode: creating a slot waits for the transactions open
	// at that moment, CommitOrder's held one among them, on the whole
	// server.
	urls := map[string]string{}
	for _, mode := range []string{bus.OutboxModeTable, bus.OutboxModeWALMessages} {
		urls[mode] = servers.StartLogicalPostgreSQL(t).URL
		db := testdb.OpenURL(t, urls[mode])
		for _, kind := range kinds[mode] {
			for name, test := range tests {
				t.Run(mode+"/"+kind+"/"+name, func(t *testing.T) {
					t.Parallel()
					test(t, newWALRig(t, urls[mode], db, kind, mode))
				})
			}
		}
	}
	t.Run("table/nats/Quarantine", func(t *testing.T) {
		t.Parallel()
		testWALQuarantine(t, newWALRig(t, urls[bus.OutboxModeTable], testdb.OpenURL(t, urls[bus.OutboxModeTable]), bus.KindNATS, bus.OutboxModeTable))
	})
}

// TestWALRelayUnseenCommit commits an event whose transaction the slot
// streams before any statement sees it: with synchronous_standby_names
// naming a standby that never comes, a commit with synchronous_commit: on
// is in the WAL, decoded and streamed, but waits for the standby before
// others see it. The relay publishes nothing of it until they do, then
// publishes it and deletes its row (before, it published the row at once,
// deleted nothing, and left the row in the outbox for good).
func TestWALRelayUnseenCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := servers.StartPostgreSQLWith(t, servers.PostgreSQLOptions{
		Conf: servers.LogicalConf + "synchronous_standby_names = 'nobody'\nsynchronous_commit = local\n"}).URL
	db := testdb.OpenURL(t, url)
	r := newWALRig(t, url, db, bus.KindNATS, bus.OutboxModeTable)
	r.cfg.Relay.BacklogInterval = 200 * time.Millisecond // how often a late relay looks for what it waits on
	s := r.startStreaming(t)

	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	var pid int
	require.NoError(t, conn.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	tx, err := conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `SET LOCAL synchronous_commit = on`)
	require.NoError(t, err)
	require.NoError(t, s.bus.Publish(ctx, tx, r.topic, walEvent(1)))
	committed := make(chan error, 1)
	go func() { committed <- tx.Commit() }()
	defer func() { _, _ = db.Exec(`SELECT pg_cancel_backend($1)`, pid) }() // a failed check leaves it waiting

	var flushed string
	testkit.Eventually(t, walWait, "the commit waiting for the standby", func() bool {
		var waiting bool
		require.NoError(t, db.QueryRow(`SELECT coalesce(wait_event = 'SyncRep', false), pg_current_wal_flush_lsn()::text
			FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting, &flushed))
		return waiting
	})
	testkit.Eventually(t, walWait, "the relay's slot streamed the commit", func() bool {
		var sent bool
		require.NoError(t, db.QueryRow(`SELECT coalesce(bool_and(sent_lsn >= $1::pg_lsn), false) FROM pg_stat_replication`, flushed).Scan(&sent))
		return sent
	})
	time.Sleep(500 * time.Millisecond) // time enough for a relay to publish and delete it
	s.mu.Lock()
	require.Empty(t, s.got, "nothing handled while no statement sees its commit")
	s.mu.Unlock()
	require.Empty(t, r.leftOffsets(t), "its row, not seen yet")
	checkTheRelayNamesTheCommit(t, r, s, int32(pid))

	// Cancelling the wait ends the commit: others see it from then on.
	_, err = db.Exec(`SELECT pg_cancel_backend($1)`, pid)
	require.NoError(t, err)
	require.NoError(t, <-committed)
	s.await(t, 1)
	testkit.Eventually(t, walWait, "the forwarded row deleted", func() bool { return r.outboxRows(t) == 0 })
}

// checkTheRelayNamesTheCommit: while the relay waits to see a commit
// that waits for a synchronous standby, it says so, naming the committing
// session, in readiness (degraded), a log line, its gauges and outbox
// status (the console's relay waits).
func checkTheRelayNamesTheCommit(t *testing.T, r *walRig, s *walService, pid int32) {
	t.Helper()
	ctx := context.Background()
	var relay bus.HealthCheck
	testkit.Eventually(t, walWait, "readiness to say the relay waits for the commit", func() bool {
		for _, c := range s.bus.Readiness(ctx).Checks {
			if c.Name == "relay" {
				relay = c
			}
		}
		return relay.Degraded
	})
	require.Contains(t, relay.Detail, fmt.Sprintf("for the commit to be seen of pid %d", pid))
	require.Contains(t, relay.Detail, "waiting for synchronous replication")
	require.Contains(t, s.logs.String(), "its COMMIT waits for a synchronous standby")
	require.Positive(t, testkit.Metric(t, s.reg, "millrace_relay_blocker_age_seconds", map[string]string{"pid": strconv.Itoa(int(pid))}))
	require.Positive(t, testkit.Metric(t, s.reg, "millrace_relay_blocked_seconds", nil))
	oc, err := ops.New(ctx, r.db, r.cfg)
	require.NoError(t, err)
	st, err := oc.OutboxStatus(ctx, "")
	require.NoError(t, err)
	require.NotEmpty(t, st.Waits, "outbox status lists the commit")
	require.Equal(t, pid, st.Waits[0].PID)
	require.True(t, st.Waits[0].Commit)
	require.True(t, strings.EqualFold("COMMIT", st.Waits[0].Query), "the session's statement: %q", st.Waits[0].Query)
}

// walRig is an outbox of its own on the private server and the config of
// services relaying it with relay.source: wal.
type walRig struct {
	cfg   bus.Config
	db    *sql.DB
	topic string
}

func newWALRig(t *testing.T, url string, db *sql.DB, kind, mode string) *walRig {
	t.Helper()
	var cfg bus.Config
	cfg.Outbox.Mode = mode
	cfg.Database.URL = url
	cfg.Database.Schema = testdb.UniqueName("wal")
	brokertest.Apply(t, kind, &cfg)
	cfg.Relay.Source = forwarder.SourceWAL
	cfg.Relay.PollInterval = 100 * time.Millisecond
	cfg.Consumer.Handlers = map[string]middleware.Config{"wal": {Ordered: new(true)}}
	r := &walRig{cfg: cfg, db: db, topic: "wal-" + cfg.Database.Schema[len(cfg.Database.Schema)-8:]}
	brokertest.Cleanup(t, kind, r.topic, r.topic)
	require.NoError(t, bus.Migrate(context.Background(), db, cfg))
	return r
}

// walService is a running service: its relay and the one handler, which
// records the aggregate versions it handles.
type walService struct {
	bus  *bus.Bus
	reg  *prometheus.Registry
	logs *testlog.Buffer
	done chan error
	stop context.CancelFunc

	mu         sync.Mutex
	got        []int64
	aggregates []string
	payloads   [][]byte
	metadata   []map[string]string
}

// start opens and runs a service.
func (r *walRig) start(t *testing.T) *walService {
	t.Helper()
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	logs := &testlog.Buffer{}
	b, err := bus.Open(ctx, r.cfg, r.db, bus.WithRegistry(reg), bus.WithLogger(logs.Slog()))
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("outbox offsets left: %v\nthe service's log:\n%s", r.leftOffsets(t), logs)
		}
	})
	s := &walService{bus: b, reg: reg, logs: logs, done: make(chan error, 1)}
	require.NoError(t, b.Handle(r.topic, "wal", func(_ context.Context, ev bus.Event) error {
		s.mu.Lock()
		s.got = append(s.got, ev.AggregateVersion)
		s.aggregates = append(s.aggregates, ev.AggregateID)
		s.payloads = append(s.payloads, ev.Payload)
		s.metadata = append(s.metadata, ev.Metadata)
		s.mu.Unlock()
		return nil
	}, bus.WithConsumerGroup(r.topic)))
	runCtx, stop := context.WithCancel(ctx)
	s.stop = stop
	go func() { s.done <- b.Run(runCtx) }()
	t.Cleanup(stop)
	return s
}

// halt stops the service, which must end cleanly.
func (s *walService) halt(t *testing.T) {
	t.Helper()
	s.stop()
	require.NoError(t, <-s.done)
}

// event is the aggregate's event of version v.
func walEvent(v int64) bus.Event {
	return bus.Event{Type: "Moved", AggregateType: "thing", AggregateID: "a", AggregateVersion: v, Payload: []byte(`{}`)}
}

// publish commits the events of the given versions, one transaction each.
func (s *walService) publish(t *testing.T, topic string, versions ...int64) {
	t.Helper()
	for _, v := range versions {
		require.NoError(t, s.bus.PublishInOwnTx(context.Background(), topic, walEvent(v)))
	}
}

// await waits until the handler handled want, in that order, and nothing else.
func (s *walService) await(t *testing.T, want ...int64) {
	t.Helper()
	testkit.Eventually(t, walWait, fmt.Sprintf("versions %v handled", want), func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.got) >= len(want)
	})
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Equal(t, want, s.got, "handled once each, in commit order")
}

// outboxRows counts the rows left in the outbox table.
func (r *walRig) outboxRows(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, r.db.QueryRow(`SELECT count(*) FROM "`+r.cfg.Database.Schema+`"."watermill_`+
		r.cfg.WithDefaults().Outbox.Topic+`"`).Scan(&n))
	return n
}

// leftOffsets lists the offsets of the rows left in the outbox table.
func (r *walRig) leftOffsets(t *testing.T) []int64 {
	t.Helper()
	return testdb.Column[int64](t, r.db, `SELECT "offset" FROM "`+r.cfg.Database.Schema+`"."watermill_`+
		r.cfg.WithDefaults().Outbox.Topic+`" ORDER BY "offset"`)
}

// startStreaming starts a service and waits until its relay streams the
// rig's slot.
func (r *walRig) startStreaming(t *testing.T) *walService {
	t.Helper()
	s := r.start(t)
	r.awaitStreaming(t)
	return s
}

// awaitStreaming waits until a relay streams the rig's slot: a WAL sender
// holds it (while the slot is created, the creating backend holds it, and
// the creation waits for the transactions open meanwhile).
func (r *walRig) awaitStreaming(t *testing.T) {
	t.Helper()
	c := r.cfg.WithDefaults()
	slot := c.Relay.SlotName(c.Database.Schema, c.Outbox.Topic)
	testkit.Eventually(t, walWait, "a relay streaming slot "+slot, func() bool {
		var streaming bool
		err := r.db.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_replication_slots s JOIN pg_stat_activity a ON a.pid = s.active_pid
			WHERE s.slot_name = $1 AND a.backend_type = 'walsender')`, slot).Scan(&streaming)
		require.NoError(t, err)
		return streaming
	})
}

// A transaction that began first and is still open holds back nothing
// committed after it; once it commits its event comes after theirs, and
// the forwarded rows leave the outbox table.
func testWALCommitOrder(t *testing.T, r *walRig) {
	ctx := context.Background()
	// Creating the slot waits for the transactions open at that moment.
	s := r.startStreaming(t)
	open, err := r.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer open.Rollback() //nolint:errcheck // a no-op after Commit
	require.NoError(t, s.bus.Publish(ctx, open, r.topic, walEvent(3)))
	var inTable int
	require.NoError(t, open.QueryRowContext(ctx, `SELECT count(*) FROM "`+r.cfg.Database.Schema+`"."watermill_`+
		r.cfg.WithDefaults().Outbox.Topic+`"`).Scan(&inTable))
	wantInTable := map[string]int{bus.OutboxModeTable: 1, bus.OutboxModeWALMessages: 0}[r.cfg.Outbox.Mode]
	require.Equal(t, wantInTable, inTable, "outbox.mode %s: a row, or a logical message and no row", r.cfg.Outbox.Mode)
	s.publish(t, r.topic, 1, 2)
	s.await(t, 1, 2) // while the first transaction is still open
	require.NoError(t, open.Commit())
	s.publish(t, r.topic, 4)
	s.await(t, 1, 2, 3, 4)
	testkit.Eventually(t, walWait, "the forwarded rows deleted", func() bool { return r.outboxRows(t) == 0 })
	// The relay counts a batch once its ack committed, after the broker
	// confirmed it: the handler may have the events first.
	values := s.awaitForwarded(t, 4)
	require.Equal(t, 4.0, values["millrace_relay_messages_forwarded_total"], "the relay's own counter")
	require.Contains(t, values, "millrace_relay_wal_retained_bytes")
}

// metrics sums the service's counters and gauges by name.
func (s *walService) metrics(t *testing.T) map[string]float64 {
	t.Helper()
	families, err := s.reg.Gather()
	require.NoError(t, err)
	values := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			values[f.GetName()] += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return values
}

// awaitForwarded waits until the relay counted n forwarded messages or
// more, and returns the metrics then.
func (s *walService) awaitForwarded(t *testing.T, n float64) map[string]float64 {
	t.Helper()
	var values map[string]float64
	testkit.Eventually(t, walWait, fmt.Sprintf("%v messages counted forwarded", n), func() bool {
		values = s.metrics(t)
		return values["millrace_relay_messages_forwarded_total"] >= n
	})
	return values
}

// With relay.shards: 4 the relay publishes each batch in four lanes by
// aggregate, on the real broker: the events of eight aggregates, committed
// eight to a transaction, arrive once each and in order per aggregate.
func testWALShards(t *testing.T, r *walRig) {
	r.cfg.Relay.Shards = new(4)
	s := r.startStreaming(t)
	const aggregates, versions = 8, 10
	for v := range int64(versions) {
		events := make([]bus.Event, aggregates)
		for a := range events {
			events[a] = walEvent(v + 1)
			events[a].AggregateID = "a" + strconv.Itoa(a)
		}
		require.NoError(t, s.bus.PublishInOwnTx(context.Background(), r.topic, events...))
	}
	testkit.Eventually(t, walWait, "every event handled", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.got) >= aggregates*versions
	})
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Len(t, s.got, aggregates*versions, "handled once each")
	last := map[string]int64{}
	for i, agg := range s.aggregates {
		require.Equal(t, last[agg]+1, s.got[i], "aggregate %s in commit order", agg)
		last[agg] = s.got[i]
	}
}

// A relay stopped and started again resumes from its slot: the events
// committed meanwhile arrive, none lost, none handled twice, and each is
// published once: the catch-up forwards them from the table, and the slot
// streams them again, found deleted and skipped.
func testWALRestart(t *testing.T, r *walRig) {
	s := r.start(t)
	s.publish(t, r.topic, 1, 2, 3)
	s.await(t, 1, 2, 3)
	s.halt(t)
	s.publish(t, r.topic, 4, 5, 6) // no relay runs
	again := r.start(t)
	again.publish(t, r.topic, 7)
	again.await(t, 4, 5, 6, 7)
	r.awaitStreaming(t)
	testkit.Eventually(t, walWait, "the forwarded rows deleted", func() bool { return r.outboxRows(t) == 0 })
	again.publish(t, r.topic, 8) // streamed after the catch-up's rows
	again.await(t, 4, 5, 6, 7, 8)
	require.Equal(t, 5.0, again.awaitForwarded(t, 5)["millrace_relay_messages_forwarded_total"], "published once each")
}

// A scheduled event reaches the consumer at its due time: the scheduler
// moves it into the outbox table, and the slot sees that insert.
func testWALScheduled(t *testing.T, r *walRig) {
	ctx := context.Background()
	s := r.startStreaming(t)
	tx, err := r.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = s.bus.Schedule(ctx, tx, r.topic, bus.DueIn(300*time.Millisecond), walEvent(2))
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	s.publish(t, r.topic, 1)
	s.await(t, 1, 2)
}

// The payload and metadata arrive byte for byte, through a table row or a
// logical message alike: JSON with white space, escapes, HTML characters
// and non-ASCII text, and metadata with the same.
func testWALBytes(t *testing.T, r *walRig) {
	s := r.startStreaming(t)
	payload := []byte("{ \"b\" : \"<é> & \\u00e9 😀\",\n\t\"a\": [1.50, 2e3, null] }")
	meta := map[string]string{"note": "<tag> & \"quote\" ünï"}
	ev := walEvent(1)
	ev.Payload, ev.Metadata = payload, meta
	require.NoError(t, s.bus.PublishInOwnTx(context.Background(), r.topic, ev))
	s.await(t, 1)
	s.mu.Lock()
	gotPayload, gotNote := s.payloads[0], s.metadata[0]["note"]
	s.mu.Unlock()
	require.Equal(t, payload, gotPayload)
	require.Equal(t, meta["note"], gotNote)
	// The relay deletes the row once the broker confirmed it, which may be
	// after the consumer handled the event.
	testkit.Eventually(t, walWait, "the forwarded row deleted", func() bool { return r.outboxRows(t) == 0 })
}

// Rows the broker refuses for good (written by plain Watermill, which
// checks nothing) go to the relay quarantine with their reason; the events
// around them flow, and no row is left in the outbox.
func testWALQuarantine(t *testing.T, r *walRig) {
	s := r.start(t)
	s.publish(t, r.topic, 1)
	r.writeWithWatermill(t, map[string]string{"bad key": "v"})
	r.writeWithWatermill(t, map[string]string{"_watermill_message_uuid": "forged"})
	s.publish(t, r.topic, 2)
	s.await(t, 1, 2)
	testkit.Eventually(t, walWait, "the refused rows quarantined", func() bool { return r.outboxRows(t) == 0 })
	reasons := testdb.Column[string](t, r.db, `SELECT reason FROM "`+r.cfg.Database.Schema+`".millrace_relay_quarantine ORDER BY id`)
	require.Len(t, reasons, 2, "both refused rows, once each: %q", reasons)
	require.Contains(t, reasons[0], "bad key")
	require.Contains(t, reasons[1], "_watermill_message_uuid")
}

// writeWithWatermill commits a row to the outbox through Watermill's own
// forwarder publisher, with metadata meta.
func (r *walRig) writeWithWatermill(t *testing.T, meta map[string]string) {
	t.Helper()
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	for k, v := range meta {
		msg.Metadata.Set(k, v)
	}
	brokertest.WriteOutboxWithWatermill(t, r.db, r.cfg, r.topic, msg)
}

// relay.source takes table or wal, and wal only with relay.shards: 1; the
// errors name the key and what it allows.
func TestWALRelayConfig(t *testing.T) {
	t.Parallel()
	cfg := bus.Config{}.WithDefaults()
	cfg.Relay.Source = "binlog"
	require.ErrorContains(t, cfg.Validate(), `relay.source: must be one of table, wal; got "binlog"`)
	cfg.Relay.Source = forwarder.SourceWAL
	require.NoError(t, cfg.Validate())
	cfg.Relay.Shards = new(4) // lanes of the one slot's batches
	require.NoError(t, cfg.Validate())
	cfg.Relay.Shards = new(1)
	cfg.Outbox.Mode = bus.OutboxModeWALMessages
	require.NoError(t, cfg.Validate())
	cfg.Relay.Source = forwarder.SourceTable
	require.ErrorContains(t, cfg.Validate(), `outbox.mode: wal_messages is read only by the WAL relay and needs relay.source: wal; got relay.source: "table"`)
	cfg.Outbox.Mode = "messages"
	require.ErrorContains(t, cfg.Validate(), `outbox.mode: must be one of table, wal_messages; got "messages"`)
	cfg.Outbox.Mode, cfg.Relay.Source = bus.OutboxModeTable, forwarder.SourceWAL
	for slot, problem := range map[string]string{
		strings.Repeat("s", 64): "relay.wal_slot: must be at most 63 characters, got 64",
		"Orders-Slot":           `relay.wal_slot: must match ^[a-z_][a-z0-9_]*$ (lowercase letters, digits, '_'), got "Orders-Slot"`,
	} {
		cfg.Relay.WALSlot = slot
		require.ErrorContains(t, cfg.Validate(), problem)
	}
	cfg.Relay.WALSlot = strings.Repeat("s", 63)
	require.NoError(t, cfg.Validate())
	cfg.Relay.Source = forwarder.SourceTable
	require.ErrorContains(t, cfg.Validate(), `relay.wal_slot: set while relay.source is "table"`)
}

// The default slot comes from the relay group, the schema and the outbox
// topic, and is a valid slot name however long or odd those are.
func TestWALRelaySlotName(t *testing.T) {
	t.Parallel()
	relay := forwarder.Config{}.WithDefaults()
	require.Equal(t, "millrace_relay_public_millrace_outbox", relay.SlotName("public", "millrace_outbox"))
	relay.ConsumerGroup = "9Billing.Relay-EU"
	require.Equal(t, "_9billing_relay_eu_app_events", relay.SlotName("app", "events"))
	long := relay.SlotName(strings.Repeat("s", 63), "events")
	require.Len(t, long, 63)
	require.NotEqual(t, long, relay.SlotName(strings.Repeat("s", 63), "events2"))
	for _, name := range []string{long, relay.SlotName("app", "events")} {
		require.NoError(t, names.Identifier(name, 63))
	}
	relay.WALSlot = "mine"
	require.Equal(t, "mine", relay.SlotName("app", "events"))
}

// On a server with wal_level below logical (the shared one), Run stops at
// once with an error naming the key, the setting and how to change it.
func TestWALRelayNeedsLogicalWAL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	svc := brokertest.NewService(t, bus.KindNATS, func(cfg *bus.Config) {
		cfg.Database.URL = testdb.URL()
		cfg.Relay.Source = forwarder.SourceWAL
	})
	b := svc.Open(t)
	runCtx, cancel := context.WithTimeout(ctx, walWait)
	defer cancel()
	err := b.Run(runCtx)
	require.ErrorIs(t, err, wal.ErrWALLevel)
	require.ErrorContains(t, err, "relay.source: wal")
	require.ErrorContains(t, err, "ALTER SYSTEM SET wal_level = logical")
}

// A service role given only what `millrace grants` prints for
// relay.source: wal, run as printed by the superuser who migrated the
// schema, runs the WAL relay as a least-privilege role: it creates its
// slot, streams it, publishes every event once, in commit order, and
// empties the outbox, with no "permission denied" on the way.
func TestWALRelayLeastPrivilege(t *testing.T) {
	t.Parallel()
	url := servers.StartLogicalPostgreSQL(t).URL
	admin := testdb.OpenURL(t, url)
	r := newWALRig(t, url, admin, bus.KindNATS, bus.OutboxModeTable)
	role := r.cfg.Database.Schema + "_svc"
	password := testdb.UniqueName("pw")
	_, err := admin.Exec(fmt.Sprintf(`CREATE ROLE %q LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '%s'`, role, password))
	require.NoError(t, err)
	grants, err := bus.GrantSQL(r.cfg, role)
	require.NoError(t, err)
	c := r.cfg.WithDefaults()
	publication := wal.PublicationSQL(c.Database.Schema, c.Outbox.Topic)
	require.Contains(t, grants, publication)
	_, err = admin.Exec(strings.Replace(grants, publication, "", 1))
	require.NoError(t, err, "the printed grants, as printed:\n%s", grants)

	r.cfg.Database.URL = roleURL(t, url, role, password)
	r.db = testdb.OpenURL(t, r.cfg.Database.URL)
	// Without the publication, which the role may not create, the relay
	// stops at once, naming the statement.
	select {
	case err := <-r.start(t).done:
		require.ErrorIs(t, err, wal.ErrPublication)
		require.ErrorContains(t, err, "CREATE PUBLICATION")
	case <-time.After(walWait):
		t.Fatal("the relay did not stop without its publication")
	}
	_, err = admin.Exec(publication)
	require.NoError(t, err)
	s := r.startStreaming(t)
	s.publish(t, r.topic, 1, 2, 3, 4, 5)
	s.await(t, 1, 2, 3, 4, 5)
	testkit.Eventually(t, walWait, "the forwarded rows deleted", func() bool { return r.outboxRows(t) == 0 })
	require.Equal(t, 5.0, s.awaitForwarded(t, 5)["millrace_relay_messages_forwarded_total"], "published once each")
	s.halt(t)
	require.NotContains(t, s.logs.String(), "permission denied")
	require.NotContains(t, s.logs.String(), "must be owner")
}

// A relay whose slot another connection still reads (as the WAL sender of
// a relay SIGKILLed holds it until PostgreSQL notices) keeps its lease
// and asks for the slot again shortly, saying why, rather than giving the
// lease up and backing off; it streams once the slot is free.
func TestWALRelayWaitsForHeldSlot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := servers.StartLogicalPostgreSQL(t).URL
	r := newWALRig(t, url, testdb.OpenURL(t, url), bus.KindNATS, bus.OutboxModeTable)
	c := r.cfg.WithDefaults()
	holder, err := wal.New(ctx, wal.Config{URL: url, Schema: c.Database.Schema, OutboxTopic: c.Outbox.Topic,
		Slot: c.Relay.SlotName(c.Database.Schema, c.Outbox.Topic)})
	require.NoError(t, err)
	holdCtx, release := context.WithCancel(ctx)
	held := make(chan error, 1)
	go func() {
		held <- holder.Run(holdCtx, func(ctx context.Context, _ wal.Batch) error { <-ctx.Done(); return ctx.Err() })
	}()
	defer release()

	s := r.start(t)
	testkit.Eventually(t, walWait, "the relay to wait for the held slot", func() bool {
		return strings.Contains(s.logs.String(), "Replication slot still read by another connection")
	})
	s.publish(t, r.topic, 1, 2)
	time.Sleep(300 * time.Millisecond) // a few more asks
	release()
	require.ErrorIs(t, <-held, context.Canceled)
	s.await(t, 1, 2)
	s.publish(t, r.topic, 3)
	s.await(t, 1, 2, 3)
	logs := s.logs.String()
	require.Equal(t, 1, strings.Count(logs, "Relay is active"), "the relay kept its lease:\n%s", logs)
	require.NotContains(t, logs, "Relay lost its lease or could not connect")
}
