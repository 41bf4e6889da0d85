package relaybench_test

import (
	"bufio"
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	watermillsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wmforwarder "github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/forwarder/wal"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testkit/child"
	"github.com/millrace-io/millrace/ops"
)

// Workload sizes, as the relay's targets are stated.
const (
	backlogEvents = 50_000
	idleWindow    = 10 * time.Second
)

// trickle is a steady load of one event per transaction at rate events/s for
// a while, at which commit-to-consumer latency is measured.
type trickle struct {
	rate     int // events per second
	duration time.Duration
	writers  int // concurrent committers, so that the rate holds on a slow machine
}

// trickles are measured in this order after the idle window: the rate the
// relay's latency target is stated at, and ten times that.
var trickles = []trickle{
	{rate: 200, duration: 5 * time.Second, writers: 4},
	{rate: 2000, duration: 3 * time.Second, writers: 32},
}

// heldTrickle is measured last, for the relays in heldRelays only: the
// 200/s trickle for 30s while a transaction unrelated to the outbox stays
// open in a session of its own, from before the first commit to after the
// last. A relay that reads only rows of transactions older than every open
// one (watermill-sql's xid8 rule) holds each event back until it ends.
var heldTrickle = trickle{rate: 200, duration: 30 * time.Second, writers: 4}

// heldRelays are measured at heldTrickle: millrace, whose read rule waits
// for no other transaction, and stock Watermill, whose forwarder reads by
// the xid8 rule, to show what that rule does. Each costs heldTrickle's 30s
// per broker, so the others are not.
var heldRelays = []string{"watermill", "millrace", walRelay, walMessagesRelay}

// brokerKit opens one broker for the parent (consumer, provisioning) and
// tells the child how to reach the same broker.
type brokerKit struct {
	// open connects to the broker; env is what the child process needs to
	// reach the same server (addresses of an in-process dev broker).
	open func(ctx context.Context, env map[string]string) (adapters.Broker, error)
	// start, when set, starts an in-process dev broker in the parent and
	// returns the env a child needs to reach it.
	start func(b *testing.B) map[string]string
}

// relays are measured in this order for each broker: stock Watermill,
// millrace, millrace as three processes on eight shards (millrace-3x8), and
// the hand-written reference (reference_test.go) as the ceiling.
var relays = []string{"watermill", "millrace", shardedRelay, walRelay, walMessagesRelay, "reference"}

// shardedRelay is millrace with relay.shards: 8 in three relay processes;
// its statements and peak RSS are the three processes' sums.
const shardedRelay = "millrace-3x8"

// walRelay is millrace with relay.source: wal, and walMessagesRelay with
// outbox.mode: wal_messages too, each with a slot of its own that exists
// before the backlog is committed (a relay down while events pile up) and
// is dropped at its end: the first forwards the backlog
// from the outbox table at its start and then streams it again from the
// slot (duplicates, which the consumer counts), the second streams it
// from the slot only.
const (
	walRelay         = "millrace-wal"
	walMessagesRelay = "millrace-walmsg"
)

// walSource tells whether relay reads the WAL.
func walSource(relay string) bool { return relay == walRelay || relay == walMessagesRelay }

// brokers is filled by brokers_test.go, one entry per adapter.
var brokers = map[string]brokerKit{}

// drainBound is how long a relay may take to drain the backlog; one that
// takes longer gets the rate it reached and no latency row.
const drainBound = 4 * time.Minute

type result struct {
	kind, relay           string
	drainRate             float64   // msgs/s
	undrained             bool      // the backlog was not drained within drainBound
	latency               []latency // one per trickle, in the order of trickles
	held                  *latency  // at heldTrickle; nil for a relay not in heldRelays
	idleQueries           float64   // statements/s
	peakRSSMB             float64
	delivered, duplicates int
	// PostgreSQL's CPU seconds and WAL MB per 10,000 events over the
	// backlog's commit and drain; zero for a relay that did not drain.
	pgCPU, walMB float64
}

var (
	resultsMu sync.Mutex
	results   []result
)

func TestMain(m *testing.M) {
	if child.Role() == relayRole {
		os.Exit(runChild())
	}
	startRun()
	code := m.Run()
	printTable()
	if path := os.Getenv(perfDocEnv); path != "" && code == 0 && len(results) > 0 {
		if err := writePerformanceDoc(path, finishRun(), results); err != nil {
			fmt.Fprintln(os.Stderr, "relaybench:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func BenchmarkRelay(b *testing.B) {
	kinds := make([]string, 0, len(brokers))
	for k := range brokers {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	// One private server for every relay of the run, so that their rows
	// compare: wal_level = logical for the WAL relays, and each relay in a
	// schema of its own, dropped at its end.
	pg := servers.StartLogicalPostgreSQL(b)
	for _, kind := range kinds {
		for _, relay := range relays {
			b.Run(kind+"/"+relay, func(b *testing.B) {
				r := measure(b, pg, kind, relay)
				sampleLoad()
				b.ReportMetric(r.drainRate, "msg/s")
				for _, l := range r.latency {
					b.ReportMetric(float64(l.p50.Microseconds())/1000, "p50-ms@"+strconv.Itoa(l.rate))
					b.ReportMetric(float64(l.p99.Microseconds())/1000, "p99-ms@"+strconv.Itoa(l.rate))
				}
				if l := r.held; l != nil {
					b.ReportMetric(float64(l.p50.Microseconds())/1000, "p50-ms@"+strconv.Itoa(l.rate)+"+tx")
					b.ReportMetric(float64(l.p99.Microseconds())/1000, "p99-ms@"+strconv.Itoa(l.rate)+"+tx")
				}
				b.ReportMetric(r.idleQueries, "idle-q/s")
				b.ReportMetric(r.peakRSSMB, "peak-RSS-MB")
				if !r.undrained {
					b.ReportMetric(r.pgCPU, "pg-cpu-s/10k")
					b.ReportMetric(r.walMB, "wal-MB/10k")
				}
				resultsMu.Lock()
				results = append(results, r)
				resultsMu.Unlock()
			})
		}
	}
}

// run is the measurement of one relay on one broker: its outbox, in a
// schema of its own, the publisher, the consumer and the relay's processes.
type run struct {
	relay  string
	pg     *servers.PostgreSQL
	db     *sql.DB
	pub    *bus.Bus
	tables store.Tables
	topic  string
	c      *brokertest.Arrivals
	procs  []*childProcess
	sent   int // events committed so far
	// mark is where PostgreSQL stood before the backlog's commit; pgCPU
	// and walMB what it spent from there to the end of the drain.
	mark         pgMark
	pgCPU, walMB float64
}

func measure(b *testing.B, pg *servers.PostgreSQL, kind, relay string) result {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r := newRun(b, ctx, pg, kind, relay)
	drain, drained := r.drain(b, ctx)
	if !drained {
		// Stock Watermill on a slow broker: its rate is what the consumer
		// got meanwhile, and the rest of the run is skipped.
		rate := float64(r.c.Distinct()) / drain.Seconds()
		r.stop()
		return result{kind: kind, relay: relay, drainRate: rate, undrained: true}
	}
	idle := r.idle()
	var lat []latency
	for _, tr := range trickles {
		lat = append(lat, r.latencyAt(b, ctx, tr, false))
	}
	var held *latency
	if slices.Contains(heldRelays, relay) {
		l := r.latencyAt(b, ctx, heldTrickle, true)
		held = &l
	}
	rss := r.stop()
	return result{
		kind: kind, relay: relay,
		drainRate:   backlogEvents / drain.Seconds(),
		latency:     lat,
		held:        held,
		idleQueries: idle,
		peakRSSMB:   rss,
		delivered:   r.c.Total(),
		duplicates:  r.c.Total() - r.c.Distinct(),
		pgCPU:       r.pgCPU,
		walMB:       r.walMB,
	}
}

// newRun makes relay's outbox in a new schema on pg, its topic and
// consumer on the broker, commits the backlog (100 events a transaction)
// and then starts the relay's processes.
func newRun(b *testing.B, ctx context.Context, pg *servers.PostgreSQL, kind, relay string) *run {
	kit := brokers[kind]
	childEnv := map[string]string{}
	if kit.start != nil {
		childEnv = kit.start(b)
	}
	dbURL := pg.URL
	db := testdb.OpenURL(b, dbURL)
	var cfg bus.Config
	if walSource(relay) {
		cfg.Relay.Source = forwarder.SourceWAL
		if relay == walMessagesRelay {
			cfg.Outbox.Mode = bus.OutboxModeWALMessages // Open creates the slot
		}
	}
	r := &run{relay: relay, pg: pg, db: db}
	schema := testdb.SchemaName(b, db, "bench_"+kind+"_"+strings.ReplaceAll(relay, "-", "_"))
	cfg.Database.URL = dbURL
	cfg.Database.Schema = schema
	cfg.Broker.NATS.URL = "nats://unused:4222"
	if err := bus.Migrate(ctx, db, cfg); err != nil {
		b.Fatal(err)
	}
	pub, err := bus.Open(ctx, cfg, db)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { pub.Close() })
	r.pub, cfg = pub, pub.Config()
	if walSource(relay) {
		// Runs after the relay's processes have stopped (cleanups run last
		// registered first).
		b.Cleanup(func() { dropSlot(b, cfg.WALSlot()) })
	}
	broker, err := kit.open(ctx, childEnv)
	if err != nil {
		b.Fatalf("open %s: %v", kind, err)
	}
	b.Cleanup(func() { broker.Close() })
	r.topic = strings.ReplaceAll(schema, "_", "-")
	group := r.topic + "-consumer"
	if err := broker.Provision(ctx, r.topic, group); err != nil {
		b.Fatal(err)
	}
	r.c = brokertest.RecordArrivals(b, broker, r.topic, group)
	r.tables = store.Tables{Schema: schema, OutboxTopic: cfg.Outbox.Topic}
	if relay == shardedRelay {
		// Recorded before the backlog is written, as the procedure for a
		// change of relay.shards has it.
		if err := r.tables.RecordShards(ctx, db, relayGroup(relay), 8); err != nil {
			b.Fatal(err)
		}
	}
	if relay == walRelay {
		if _, err := wal.CreateSlot(ctx, cfg.WALSlot()); err != nil {
			b.Fatal(err)
		}
	}
	r.mark = markPG(b, ctx, pg, db)
	r.commitBacklog(b, ctx)
	outbox := forwarder.Outbox{Schema: schema, Topic: cfg.Outbox.Topic}
	r.procs = []*childProcess{startChild(b, relay, kind, dbURL, outbox, childEnv)}
	if relay == shardedRelay {
		r.procs = append(r.procs, startChild(b, relay, kind, dbURL, outbox, childEnv), startChild(b, relay, kind, dbURL, outbox, childEnv))
	}
	return r
}

// commitBacklog commits backlogEvents events, 100 a transaction, over 1000
// aggregates.
func (r *run) commitBacklog(b *testing.B, ctx context.Context) {
	events := make([]bus.Event, backlogEvents)
	for i := range events {
		events[i] = bus.Event{Type: "BenchHappened", AggregateType: "bench", AggregateID: "agg-" + strconv.Itoa(i%1000),
			AggregateVersion: int64(i/1000 + 1), Payload: []byte(`{"n":` + strconv.Itoa(i) + `,"pad":"0123456789abcdef0123456789abcdef"}`)}
	}
	for start := 0; start < len(events); start += 100 {
		if err := r.pub.PublishInOwnTx(ctx, r.topic, events[start:start+100]...); err != nil {
			b.Fatal(err)
		}
	}
	r.sent = backlogEvents
}

// drain waits until the relay has forwarded the backlog and returns how
// long it took, or false after drainBound. A drained relay must then have
// 0 pending in `millrace outbox status` (stock Watermill, whose position
// millrace no longer reads, excepted), and the consumer must get every
// event.
func (r *run) drain(b *testing.B, ctx context.Context) (time.Duration, bool) {
	began := time.Now()
	for r.pending(b, ctx) {
		if time.Since(began) > drainBound {
			return time.Since(began), false
		}
		time.Sleep(20 * time.Millisecond)
	}
	took := time.Since(began)
	r.pgCPU, r.walMB = r.mark.per10k(b, ctx, r.pg, r.db, backlogEvents)
	if r.relay != "watermill" {
		oc, err := ops.New(ctx, r.db, r.pub.Config())
		if err != nil {
			b.Fatal(err)
		}
		if st, err := oc.OutboxStatus(ctx, relayGroup(r.relay)); err != nil || st.Pending != 0 {
			b.Fatalf("after the drain: outbox status %+v, %v", st, err)
		}
	}
	testkit.Eventually(b, 10*time.Minute, "the consumer to get the backlog", func() bool { return r.c.Distinct() >= backlogEvents })
	return took, true
}

// pending says whether the relay has a committed row left to forward,
// by a probe that stops at the first it finds on an index, so that polling
// it during a drain loads PostgreSQL alike for every relay, however many
// rows are pending or kept for retention. For stock Watermill: a row past
// its position in watermill-sql's offsets table by the xid8 rule, on the
// primary key. For millrace: a row a shard's cursor has not forwarded
// (store.Tables.HasBacklog). For the reference, which has no cursor and
// deletes what it sent, HasBacklog finds any row.
func (r *run) pending(b *testing.B, ctx context.Context) bool {
	if walSource(r.relay) {
		// Whatever the table holds, the slot holds too, and with
		// wal_messages the table holds nothing: the consumer tells.
		return r.c.Distinct() < backlogEvents
	}
	if r.relay == "watermill" {
		var pending bool
		offsets := r.tables.OffsetsTable()
		err := r.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM `+r.tables.OutboxTable()+` m
			WHERE (m.transaction_id, m."offset") > (
				coalesce((SELECT last_processed_transaction_id FROM `+offsets+` WHERE consumer_group = $1), '0'::xid8),
				coalesce((SELECT offset_acked FROM `+offsets+` WHERE consumer_group = $1), 0)))`, relayGroup(r.relay)).Scan(&pending)
		if err != nil {
			b.Fatal(err)
		}
		return pending
	}
	cursors := []store.Cursor{{Group: relayGroup(r.relay)}}
	if r.relay == shardedRelay {
		cursors = cursors[:0]
		for shard := range 8 {
			cursors = append(cursors, store.Cursor{Group: relayGroup(r.relay), Shard: shard, Shards: 8})
		}
	}
	for _, c := range cursors {
		pending, err := r.tables.HasBacklog(ctx, r.db, c)
		if err != nil {
			b.Fatal(err)
		}
		if pending {
			return true
		}
	}
	return false
}

// idle lets the relay settle into idle and returns the statements per
// second it sends over idleWindow.
func (r *run) idle() float64 {
	time.Sleep(2 * time.Second)
	q0 := r.statements()
	time.Sleep(idleWindow)
	return float64(r.statements()-q0) / idleWindow.Seconds()
}

// statements counts the SQL statements the relay's processes have sent.
func (r *run) statements() (n int64) {
	for _, p := range r.procs {
		n += p.statements()
	}
	return n
}

// stop stops the relay's processes and returns the sum of their peak RSS.
func (r *run) stop() (rssMB float64) {
	for _, p := range r.procs {
		rssMB += p.peakRSS()
		p.stop()
	}
	return rssMB
}

// latency is commit-to-consumer latency at one trickle.
type latency struct {
	rate     int     // the trickle's target, events/s
	held     bool    // measured beside an open transaction
	achieved float64 // the rate the writers kept, events/s
	events   int
	p50, p99 time.Duration
}

// name is the trickle's name in the table's notes: "200/s", "200/s+tx".
func (l latency) name() string {
	if l.held {
		return strconv.Itoa(l.rate) + "/s+tx"
	}
	return strconv.Itoa(l.rate) + "/s"
}

// latencyAt commits tr, beside a transaction held open from before its
// first commit to after its last when hold is set, waits for the consumer
// to have it all and returns the latency from each commit to the
// consumer's first receipt.
func (r *run) latencyAt(b *testing.B, ctx context.Context, tr trickle, hold bool) latency {
	var end func()
	if hold {
		end = openTransaction(b, ctx, r.db)
	}
	committed, start := commitTrickle(b, ctx, r.pub, r.topic, tr)
	if hold {
		end()
	}
	n := len(committed)
	testkit.Eventually(b, 5*time.Minute, fmt.Sprintf("the %d/s trickle to arrive", tr.rate), func() bool { return r.c.Distinct() >= r.sent+n })
	r.sent += n
	lat := make([]time.Duration, 0, n)
	var last time.Time
	for id, at := range committed {
		arrived, _ := r.c.At(id)
		lat = append(lat, arrived.Sub(at))
		if at.After(last) {
			last = at
		}
	}
	slices.Sort(lat)
	return latency{
		rate: tr.rate, held: hold, achieved: float64(n) / last.Sub(start).Seconds(), events: n,
		p50: lat[len(lat)/2], p99: lat[len(lat)*99/100],
	}
}

// commitTrickle commits tr.rate events a second, one per transaction, for
// tr.duration, from tr.writers goroutines on one shared schedule (event i is
// due at i/rate; a writer that falls behind commits at once), and returns
// when each event's transaction had committed, by event id, and when the
// schedule began.
func commitTrickle(b *testing.B, ctx context.Context, pub *bus.Bus, topic string, tr trickle) (committed map[string]time.Time, start time.Time) {
	n := int(tr.duration.Seconds() * float64(tr.rate))
	interval := time.Second / time.Duration(tr.rate)
	var mu sync.Mutex
	committed = make(map[string]time.Time, n)
	var failed atomic.Pointer[error]
	var writers sync.WaitGroup
	start = time.Now()
	for w := range tr.writers {
		writers.Go(func() {
			aggregate := "trickle-" + strconv.Itoa(tr.rate) + "-" + strconv.Itoa(w)
			for i := w; i < n; i += tr.writers {
				time.Sleep(time.Until(start.Add(time.Duration(i) * interval)))
				id := watermill.NewUUID()
				if err := pub.PublishInOwnTx(ctx, topic, bus.Event{ID: id, Type: "BenchTrickle", AggregateType: "bench",
					AggregateID: aggregate, AggregateVersion: int64(i/tr.writers + 1), Payload: []byte(`{}`)}); err != nil {
					failed.Store(&err)
					return
				}
				at := time.Now()
				mu.Lock()
				committed[id] = at
				mu.Unlock()
			}
		})
	}
	writers.Wait()
	if err := failed.Load(); err != nil {
		b.Fatal(*err)
	}
	return committed, start
}

// openTransaction begins a transaction in a session of its own, touching
// no table, takes a transaction id, so that every snapshot lists it as in
// progress until it ends, and leaves the session idle in it. end rolls it
// back; the benchmark fails if the transaction did not stay open until
// then.
func openTransaction(b *testing.B, ctx context.Context, db *sql.DB) (end func()) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		b.Fatal(err)
	}
	var xid string
	if _, err := tx.ExecContext(ctx, `SET LOCAL idle_in_transaction_session_timeout = 0`); err != nil {
		b.Fatal(err)
	}
	if err := tx.QueryRowContext(ctx, `SELECT pg_current_xact_id()::text`).Scan(&xid); err != nil {
		b.Fatal(err)
	}
	return func() {
		var status string
		if err := db.QueryRowContext(ctx, `SELECT pg_xact_status($1::text::xid8)`, xid).Scan(&status); err != nil || status != "in progress" {
			b.Fatalf("the open transaction %s: %q, %v", xid, status, err)
		}
		if err := tx.Rollback(); err != nil {
			b.Fatal(err)
		}
	}
}

// relayGroup is the position of relay: millrace's cursor row (one per
// shard for millrace-3x8), stock Watermill's row of watermill-sql's offsets
// table; the reference has none and deletes what it sent, so everything
// left in its outbox is pending.
func relayGroup(relay string) string {
	switch relay {
	case "watermill":
		return "watermill_forwarder"
	case "reference":
		return "reference_relay"
	}
	return "millrace_relay"
}

// relayRole is the child.Role of a relay process; RELAYBENCH_CHILD names
// which relay it runs.
const relayRole = "relaybench-relay"

// childProcess is a relay running in a re-executed test binary.
type childProcess struct {
	proc      *child.Process
	countFile string
}

func startChild(b *testing.B, relay, kind, dbURL string, outbox forwarder.Outbox, extra map[string]string) *childProcess {
	dir := b.TempDir()
	c := &childProcess{countFile: filepath.Join(dir, "statements")}
	env := []string{"RELAYBENCH_CHILD=" + relay, "RELAYBENCH_KIND=" + kind, "RELAYBENCH_DB=" + dbURL,
		"RELAYBENCH_SCHEMA=" + outbox.Schema, "RELAYBENCH_OUTBOX=" + outbox.Topic, "RELAYBENCH_COUNT_FILE=" + c.countFile}
	for k, v := range extra {
		env = append(env, k+"="+v)
	}
	c.proc = child.Start(b, child.Options{Role: relayRole, Env: env, Stdout: os.Stderr})
	b.Cleanup(c.stop)
	return c
}

func (c *childProcess) statements() int64 {
	data, _ := os.ReadFile(c.countFile)
	n, _ := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	return n
}

// peakRSS reads the child's high-water mark of resident memory, in MB.
func (c *childProcess) peakRSS() float64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", c.proc.Pid()))
	if err != nil {
		return 0
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if rest, ok := strings.CutPrefix(s.Text(), "VmHWM:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

// stop stops the relay with SIGTERM, killing it after 30s.
func (c *childProcess) stop() { _ = c.proc.Stop(30 * time.Second) }

// runChild runs one relay until SIGTERM, counting its SQL statements.
func runChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	var statements atomic.Int64
	go func() {
		// Written aside and renamed, so the parent never reads a truncated file.
		countFile := os.Getenv("RELAYBENCH_COUNT_FILE")
		for ctx.Err() == nil {
			if os.WriteFile(countFile+".new", []byte(strconv.FormatInt(statements.Load(), 10)), 0o600) == nil {
				_ = os.Rename(countFile+".new", countFile)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	if dir := os.Getenv("RELAYBENCH_PROFILE_DIR"); dir != "" {
		stopProfiles, err := profile(dir, os.Getenv("RELAYBENCH_KIND")+"-"+os.Getenv("RELAYBENCH_CHILD"))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer stopProfiles()
	}
	cc, err := pgx.ParseConfig(os.Getenv("RELAYBENCH_DB"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	db := sql.OpenDB(countingConnector{Connector: stdlib.GetConnector(*cc), n: &statements})
	defer db.Close()
	kind := os.Getenv("RELAYBENCH_KIND")
	env := map[string]string{}
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	broker, err := brokers[kind].open(ctx, env)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child: open broker:", err)
		return 1
	}
	defer broker.Close()
	outbox := forwarder.Outbox{Schema: os.Getenv("RELAYBENCH_SCHEMA"), Topic: os.Getenv("RELAYBENCH_OUTBOX")}
	if err := runRelay(ctx, os.Getenv("RELAYBENCH_CHILD"), db, broker, outbox, &statements); err != nil && ctx.Err() == nil {
		fmt.Fprintln(os.Stderr, os.Getenv("RELAYBENCH_CHILD")+" relay:", err)
		return 1
	}
	return 0
}

// runRelay runs relay on db and broker until ctx is done; the reference
// counts its own statements in statements.
func runRelay(ctx context.Context, relay string, db *sql.DB, broker adapters.Broker, outbox forwarder.Outbox, statements *atomic.Int64) error {
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if os.Getenv("RELAYBENCH_VERBOSE") != "" {
		logger = watermill.NewStdLogger(false, false)
	}
	switch relay {
	case "millrace", shardedRelay, walRelay, walMessagesRelay:
		var cfg forwarder.Config
		if relay == shardedRelay {
			cfg.Shards = new(8)
		}
		if walSource(relay) {
			cfg.Source = forwarder.SourceWAL
		}
		f, err := forwarder.New(db, broker, outbox, cfg, forwarder.Options{Logger: logger, ReplicationURL: os.Getenv("RELAYBENCH_DB")})
		if err != nil {
			return err
		}
		return f.Run(ctx)
	case "watermill":
		tables := store.Tables{Schema: outbox.Schema, OutboxTopic: outbox.Topic}
		sub, err := watermillsql.NewSubscriber(db, watermillsql.SubscriberConfig{
			ConsumerGroup:  relayGroup("watermill"),
			SchemaAdapter:  tables.SchemaAdapter(),
			OffsetsAdapter: tables.OffsetsAdapter(),
		}, logger)
		if err != nil {
			return err
		}
		fwd, err := wmforwarder.NewForwarder(sub, broker.Publisher(), logger, wmforwarder.Config{ForwarderTopic: outbox.Topic})
		if err != nil {
			return err
		}
		go func() { <-ctx.Done(); _ = fwd.Close() }()
		return fwd.Run(ctx)
	case "reference":
		return runReference(ctx, os.Getenv("RELAYBENCH_DB"), outbox.Schema, outbox.Topic, broker, statements)
	}
	return fmt.Errorf("no relay %q", relay)
}

// profile writes the child's CPU profile, and on stop its allocations, to
// dir as <name>.cpu.pprof and <name>.allocs.pprof (RELAYBENCH_PROFILE_DIR).
func profile(dir, name string) (stop func(), err error) {
	cpu, err := os.Create(filepath.Join(dir, name+".cpu.pprof"))
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(cpu); err != nil {
		cpu.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		cpu.Close()
		if f, err := os.Create(filepath.Join(dir, name+".allocs.pprof")); err == nil {
			_ = pprof.Lookup("allocs").WriteTo(f, 0)
			f.Close()
		}
	}, nil
}

// countingConnector counts the statements a relay sends (queries and execs,
// not BEGIN/COMMIT), so idle load compares like with like.
type countingConnector struct {
	driver.Connector
	n *atomic.Int64
}

func (c countingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &countingConn{stdConn: conn.(*stdlib.Conn), n: c.n}, nil
}

// stdConn names the embedded field so that it does not hide the promoted
// Conn() method the relay's LISTEN needs.
type stdConn = stdlib.Conn

type countingConn struct {
	*stdConn
	n *atomic.Int64
}

func (c *countingConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	c.n.Add(1)
	return c.stdConn.QueryContext(ctx, query, args)
}

func (c *countingConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	c.n.Add(1)
	return c.stdConn.ExecContext(ctx, query, args)
}

// printTable prints one table per broker: every relay's drain, its share of
// the reference's, latency at each trickle and beside the open transaction,
// idle statements, peak RSS, duplicates, and PostgreSQL's CPU and WAL per
// 10,000 events, then millrace's ratios to stock Watermill.
func printTable() {
	resultsMu.Lock()
	defer resultsMu.Unlock()
	byKey := map[string]result{}
	var kinds []string
	for _, r := range results {
		byKey[r.kind+"/"+r.relay] = r
		if !slices.Contains(kinds, r.kind) {
			kinds = append(kinds, r.kind)
		}
	}
	for _, k := range kinds {
		printBroker(k, byKey)
	}
}

// printBroker prints the table of broker kind.
func printBroker(kind string, byKey map[string]result) {
	fmt.Println()
	fmt.Printf("Relay to %s: %d-event backlog drained, then commit-to-consumer latency at", kind, backlogEvents)
	for _, tr := range trickles {
		fmt.Printf(" %d/s", tr.rate)
	}
	fmt.Printf(", and at %d/s for %s beside a transaction held open (+tx)\n", heldTrickle.rate, heldTrickle.duration)
	fmt.Printf("%-13s %11s %9s", "relay", "drain msg/s", "%ceiling")
	for _, tr := range trickles {
		fmt.Printf(" %10s %10s", "p50@"+strconv.Itoa(tr.rate), "p99@"+strconv.Itoa(tr.rate))
	}
	fmt.Printf(" %10s %10s", "p50@"+strconv.Itoa(heldTrickle.rate)+"+tx", "p99@"+strconv.Itoa(heldTrickle.rate)+"+tx")
	fmt.Printf(" %8s %9s %5s %11s %10s\n", "idle q/s", "peak RSS", "dups", "pg cpu/10k", "WAL/10k")
	ceiling, okC := byKey[kind+"/reference"]
	var notes []string
	for _, relay := range relays {
		r, ok := byKey[kind+"/"+relay]
		if !ok {
			continue
		}
		pct := "-"
		if okC {
			pct = fmt.Sprintf("%.1f%%", 100*r.drainRate/ceiling.drainRate)
		}
		if r.undrained {
			fmt.Printf("%-13s %11s %9s  did not drain %d events within %s\n", r.relay, fmt.Sprintf("<%.0f", r.drainRate), pct, backlogEvents, drainBound)
			continue
		}
		fmt.Printf("%-13s %11.0f %9s", r.relay, r.drainRate, pct)
		for _, l := range append(slices.Clone(r.latency), r.heldOrZero()) {
			if l.events == 0 {
				fmt.Printf(" %10s %10s", "-", "-")
				continue
			}
			fmt.Printf(" %10s %10s", ms(l.p50), ms(l.p99))
			if l.achieved < 0.95*float64(l.rate) {
				notes = append(notes, fmt.Sprintf("%s: the %s trickle reached %.0f/s", r.relay, l.name(), l.achieved))
			}
		}
		fmt.Printf(" %8.2f %7.1fMB %5d %10.2fs %8.1fMB\n", r.idleQueries, r.peakRSSMB, r.duplicates, r.pgCPU, r.walMB)
	}
	printRatios(byKey[kind+"/watermill"], byKey[kind+"/millrace"])
	for _, n := range notes {
		fmt.Println("  " + n)
	}
}

// heldOrZero is r's latency beside the open transaction, or a zero latency
// (no events) when r was not measured there.
func (r result) heldOrZero() latency {
	if r.held == nil {
		return latency{}
	}
	return *r.held
}

// printRatios prints millrace's ratios to stock Watermill s: drain, and
// each latency, PostgreSQL CPU and WAL (Watermill's over millrace's: lower
// is better), when both drained.
func printRatios(s, m result) {
	if s.relay == "" || m.relay == "" || s.undrained || m.undrained {
		return
	}
	fmt.Printf("%-13s %10.1fx %9s", "vs watermill", m.drainRate/s.drainRate, "")
	sl, ml := append(slices.Clone(s.latency), s.heldOrZero()), append(slices.Clone(m.latency), m.heldOrZero())
	for i := range ml {
		if sl[i].events == 0 || ml[i].events == 0 {
			fmt.Printf(" %10s %10s", "-", "-")
			continue
		}
		fmt.Printf(" %9.1fx %9.1fx", float64(sl[i].p50)/float64(ml[i].p50), float64(sl[i].p99)/float64(ml[i].p99))
	}
	fmt.Printf(" %8s %9s %5s %10.1fx %8.1fx\n", "", "", "", s.pgCPU/m.pgCPU, s.walMB/m.walMB)
}

// ms shows d in milliseconds, or in seconds from 10s on.
func ms(d time.Duration) string {
	if d >= 10*time.Second {
		return strconv.FormatFloat(d.Seconds(), 'f', 2, 64) + "s"
	}
	return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 1, 64) + "ms"
}
