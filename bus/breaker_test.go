package bus_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testlog"
	"github.com/millrace-io/millrace/middleware"
)

// A dozen messages that keep failing, redelivered after a consumer restart
// beside healthy ones, neither open the breaker nor hold the healthy
// messages back: the healthy ones drain while the flaky ones are still
// failing, on every broker. The flaky ones fail until the test lets them
// succeed (well within retry.max_attempts), then are processed once each;
// nothing is poisoned.
func TestFlakyMessagesAfterARestartDoNotHoldBackHealthyOnes(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testFlakyAfterRestart)
}

func testFlakyAfterRestart(t *testing.T, kind string) {
	const flakyCount, healthyCount = 12, 36
	r := newBreakerRig(t, kind, func(cfg *bus.Config) {
		// The breaker and the workers at their defaults; attempts enough that
		// the flaky messages are never poisoned while the test holds them.
		cfg.Consumer.Retry = middleware.RetryConfig{MaxAttempts: 25, InitialInterval: 200 * time.Millisecond,
			MaxInterval: 2 * time.Second, MaxElapsed: 30 * time.Minute}
	})
	tl, flaky := newTimeline(), map[string]bool{}
	var flakyIDs, healthy []string
	for i := range flakyCount {
		id := fmt.Sprintf("flaky-%02d", i)
		flaky[id] = true
		flakyIDs = append(flakyIDs, id)
	}
	released := make(chan struct{})
	handler := func(ctx context.Context, ev bus.Event) error {
		if flaky[ev.ID] {
			select {
			case <-released:
			default:
				tl.add("fail", ev.ID)
				return errors.New("pricing service answered 503 for this order")
			}
		}
		if _, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO `+r.schema+`.handled (event_id) VALUES ($1)`, ev.ID); err != nil {
			return err
		}
		tl.add("ok", ev.ID)
		return nil
	}

	// The first consumer gets the flaky messages among healthy ones, and
	// stops once the healthy ones drained, while the flaky ones wait for
	// their next attempt. The second consumer gets the flaky ones again
	// first, then new healthy ones.
	var drained [2]time.Duration
	var c *runningBus
	for phase := range 2 {
		var batch []string
		for i := range healthyCount {
			id := fmt.Sprintf("healthy-%d-%02d", phase, i)
			batch = append(batch, id)
			healthy = append(healthy, id)
			if phase == 0 && i%3 == 0 {
				batch = append(batch, flakyIDs[i/3])
			}
		}
		if c != nil {
			c.stop() // the restart
		}
		r.publish(batch...)
		started := time.Now()
		c = r.start(handler)
		testkit.Eventually(t, 5*time.Minute, "every healthy message handled", func() bool {
			return r.handled(healthy) == len(healthy)
		})
		drained[phase] = time.Since(started)
		mark := tl.len()
		require.Zero(t, r.handled(flakyIDs), "the healthy messages drained while the flaky ones kept failing")
		testkit.Eventually(t, 3*time.Minute, "each flaky message failing, also after the healthy ones drained", func() bool {
			for _, id := range flakyIDs {
				if tl.count("fail", id, 0) == 0 {
					return false
				}
			}
			return tl.count("fail", "", mark) > 0
		})
	}
	defer c.stop()
	t.Logf("%s: %d healthy messages beside %d flaky ones that kept failing drained in %s, and in %s after a restart; breaker opened %d times",
		kind, healthyCount, flakyCount, drained[0].Round(10*time.Millisecond), drained[1].Round(10*time.Millisecond), r.breakerOpenings())
	require.Zero(t, r.poisoned(), "nothing poisoned")
	close(released)
	testkit.Eventually(t, 3*time.Minute, "every flaky message handled once let", func() bool {
		return r.handled(flakyIDs) == len(flaky)
	})
	r.requireOnce(append(healthy, flakyIDs...))
	require.Zero(t, r.poisoned(), "nothing poisoned")
}

// Handlers that ignore their context, on every worker, hold back neither
// the breaker nor the healthy events published 5s later on the same topic:
// each hung attempt is abandoned at handler_timeout, and the healthy events
// are processed then, while the hung ones are still being retried (and
// before any of them is poisoned), on every broker.
func TestHungHandlersDoNotHoldBackHealthyEvents(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testHungHandlers)
}

func testHungHandlers(t *testing.T, kind string) {
	const workers, hungCount, healthyCount, maxAttempts = 4, 4, 3, 3
	const handlerTimeout, healthyDelay = 8 * time.Second, 5 * time.Second
	r := newBreakerRig(t, kind, func(cfg *bus.Config) {
		cfg.Consumer.Workers = workers
		cfg.Consumer.HandlerTimeout = handlerTimeout
		cfg.Consumer.Retry = middleware.RetryConfig{MaxAttempts: maxAttempts, InitialInterval: 100 * time.Millisecond,
			MaxInterval: time.Second, MaxElapsed: 30 * time.Minute}
	})
	tl := newTimeline()
	hung := map[string]bool{}
	var hungIDs, healthy []string
	for i := range hungCount {
		id := fmt.Sprintf("hung-%d", i)
		hung[id] = true
		hungIDs = append(hungIDs, id)
	}
	for i := range healthyCount {
		healthy = append(healthy, fmt.Sprintf("healthy-%d", i))
	}
	release := make(chan struct{})
	var releaseOnce sync.Once
	defer releaseOnce.Do(func() { close(release) })
	handler := func(ctx context.Context, ev bus.Event) error {
		if hung[ev.ID] {
			tl.add("call", ev.ID)
			<-release // ignores its context
			return nil
		}
		if _, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO `+r.schema+`.handled (event_id) VALUES ($1)`, ev.ID); err != nil {
			return err
		}
		tl.add("ok", ev.ID)
		return nil
	}
	c := r.start(handler)
	defer c.stop()
	r.publish(hungIDs...)
	hungAt := time.Now()
	testkit.Eventually(t, time.Minute, "every worker in a hung attempt", func() bool {
		return tl.count("call", "", 0) == hungCount
	})
	time.Sleep(time.Until(hungAt.Add(healthyDelay)))
	r.publish(healthy...)
	published := time.Now()
	testkit.Eventually(t, 5*time.Minute, "the healthy events handled", func() bool {
		return r.handled(healthy) == len(healthy)
	})
	took, sinceHung := time.Since(published), time.Since(hungAt)
	t.Logf("%s: %d healthy events handled %s after they were published, %s after %d hung attempts started on all %d workers (handler_timeout %s); breaker opened %d times so far",
		kind, len(healthy), took.Round(10*time.Millisecond), sinceHung.Round(10*time.Millisecond), hungCount, workers, handlerTimeout, r.breakerOpenings())
	require.Zero(t, r.poisoned(), "the healthy events were handled before any hung one was poisoned")
	drainedAt := tl.len()
	testkit.Eventually(t, 5*time.Minute, "the hung events poisoned after their attempts", func() bool {
		return r.poisoned() == hungCount
	})
	for _, id := range hungIDs {
		require.Equal(t, maxAttempts, tl.count("call", id, 0), "%s: one call per attempt", id)
		require.Positive(t, tl.count("call", id, drainedAt), "%s was still being retried when the healthy events were done", id)
	}
	r.requireOnce(healthy)
}

// breakerRig is one consumer group on a fresh topic of a real broker, with
// a table of the effects its handler committed.
type breakerRig struct {
	t      *testing.T
	cfg    bus.Config
	db     *sql.DB
	broker adapters.Broker
	topic  string
	group  string
	schema string
	logs   testlog.Buffer
}

func newBreakerRig(t *testing.T, kind string, configure func(*bus.Config)) *breakerRig {
	ctx := context.Background()
	svc := brokertest.NewService(t, kind, func(cfg *bus.Config) { cfg.Relay.Enabled = new(bool) }, configure)
	db, cfg := svc.DB, svc.Config
	suffix := "_" + testkit.Suffix()
	r := &breakerRig{t: t, cfg: cfg, db: db, topic: "orders-" + suffix, group: "billing-" + suffix,
		schema: `"` + cfg.Database.Schema + `"`}
	brokertest.Cleanup(t, kind, r.topic, r.group)
	_, err := db.Exec(`CREATE TABLE ` + r.schema + `.handled (event_id TEXT NOT NULL)`)
	require.NoError(t, err)
	r.broker, err = bus.OpenBroker(ctx, cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.broker.Close() })
	require.NoError(t, r.broker.Provision(ctx, r.topic, r.group))
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(r.logs.String())
		}
	})
	return r
}

// publish publishes events with the given ids straight to the broker.
func (r *breakerRig) publish(ids ...string) {
	r.t.Helper()
	msgs := make([]*message.Message, len(ids))
	for i, id := range ids {
		msgs[i] = delivered(context.Background(), id, orderCreated("o-"+id))
	}
	require.NoError(r.t, r.broker.Publisher().Publish(r.topic, msgs...))
}

// runningBus is a Bus running the rig's handler until stop.
type runningBus struct {
	stop func()
}

// start runs a Bus with handler as the rig's consumer group.
func (r *breakerRig) start(handler bus.HandlerFunc) *runningBus {
	r.t.Helper()
	b, err := bus.Open(context.Background(), r.cfg, r.db, bus.WithLogger(r.logs.Slog()))
	require.NoError(r.t, err)
	require.NoError(r.t, b.Handle(r.topic, r.group, handler))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	var once sync.Once
	return &runningBus{stop: func() {
		once.Do(func() {
			cancel()
			require.NoError(r.t, <-done)
			require.NoError(r.t, b.Close())
		})
	}}
}

// handled counts the distinct ids of ids whose effect committed.
func (r *breakerRig) handled(ids []string) int {
	r.t.Helper()
	var n int
	require.NoError(r.t, r.db.QueryRow(`SELECT count(DISTINCT event_id) FROM `+r.schema+`.handled WHERE event_id = ANY($1)`, ids).Scan(&n))
	return n
}

// requireOnce checks that each of ids has exactly one committed effect.
func (r *breakerRig) requireOnce(ids []string) {
	r.t.Helper()
	var n, distinct int
	require.NoError(r.t, r.db.QueryRow(`SELECT count(*), count(DISTINCT event_id) FROM `+r.schema+`.handled WHERE event_id = ANY($1)`, ids).Scan(&n, &distinct))
	require.Equal(r.t, len(ids), distinct, "every event handled")
	require.Equal(r.t, len(ids), n, "one effect per event")
}

// poisoned counts the poisoned messages.
func (r *breakerRig) poisoned() int {
	r.t.Helper()
	var n int
	require.NoError(r.t, r.db.QueryRow(`SELECT count(*) FROM `+r.schema+`.millrace_poison`).Scan(&n))
	return n
}

// breakerOpenings counts the times the handler's breaker opened, from the log.
func (r *breakerRig) breakerOpenings() int {
	n := 0
	for line := range strings.SplitSeq(r.logs.String(), "\n") {
		if strings.Contains(line, "Circuit breaker changed state") && strings.Contains(line, "to=open") {
			n++
		}
	}
	return n
}

// timeline records what handlers did, in order.
type timeline struct {
	mu      sync.Mutex
	entries []timelineEntry
}

type timelineEntry struct{ what, id string }

func newTimeline() *timeline { return &timeline{} }

func (tl *timeline) add(what, id string) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.entries = append(tl.entries, timelineEntry{what: what, id: id})
}

// count counts the entries of what (and of id, unless it is empty) from
// index from on.
func (tl *timeline) count(what, id string, from int) int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	n := 0
	for _, e := range tl.entries[min(from, len(tl.entries)):] {
		if e.what == what && (id == "" || e.id == id) {
			n++
		}
	}
	return n
}

// len is the number of entries so far.
func (tl *timeline) len() int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return len(tl.entries)
}

// Handlers that block for ever regardless of their context hold neither
// their workers nor the stop, on every broker: each attempt is abandoned at
// handler_timeout, the blocked events are retried and then poisoned with
// attempts == retry.max_attempts, every other event is processed exactly
// once (an ordered handler's included, the blocked aggregate's later events
// after its blocked event was poisoned), and Run returns within the
// promised bound with blocked handlers in flight, which it nacks rather
// than poisons. The blocked handlers finish at the end of the test and
// commit nothing.
func TestBlockedHandlersAreAbandoned(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testBlockedHandlers)
}

// blockedEvent is the event type whose handler blocks for ever.
const blockedEvent = "Blocked"

// stuckHandlers counts the calls of the blocking handler and holds it until
// release is closed.
type stuckHandlers struct {
	release chan struct{}
	mu      sync.Mutex
	calls   map[string]int // event id -> calls
}

func (s *stuckHandlers) block(ev bus.Event) {
	s.mu.Lock()
	s.calls[ev.ID]++
	s.mu.Unlock()
	<-s.release // ignores its context
}

func (s *stuckHandlers) callsOf(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[id]
}

// blockedRig is one broker's service with an unordered handler (pool) and
// an ordered one (ledger), some of whose events block for ever.
type blockedRig struct {
	t                   *testing.T
	kind                string
	db                  *sql.DB
	schema              string // quoted
	b                   *bus.Bus
	reg                 *prometheus.Registry
	logs                *testlog.Buffer
	stuck               *stuckHandlers
	release             func()
	poolTopic, pool     string
	ledgerTopic, ledger string
	running             *testkit.Running
	blocked, healthy    []string // event ids
	aLater, others      []string // ledger event ids after A's blocked one, and of B..F
}

const blockedTimeout, blockedAttempts = 2 * time.Second, 3

func testBlockedHandlers(t *testing.T, kind string) {
	r := newBlockedRig(t, kind)
	r.run()
	r.publishBatch()
	r.waitSettled()
	r.checkPoisoned()
	r.checkAbandonedMetrics()
	r.checkOrder()
	r.stopWithBlockedInFlight()
	r.checkAbandonedCommitNothing()
}

// newBlockedRig opens a service on kind with the handled table every
// handler writes to.
func newBlockedRig(t *testing.T, kind string) *blockedRig {
	suffix := "_" + testkit.Suffix()
	r := &blockedRig{t: t, kind: kind, reg: prometheus.NewRegistry(), logs: &testlog.Buffer{},
		poolTopic: "pool-" + suffix, pool: "pool-h-" + suffix, ledgerTopic: "ledger-" + suffix, ledger: "ledger-h-" + suffix}
	s := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Consumer.Workers = 8
		cfg.Consumer.HandlerTimeout = blockedTimeout
		cfg.Consumer.Retry = middleware.RetryConfig{MaxAttempts: blockedAttempts, InitialInterval: 50 * time.Millisecond,
			MaxInterval: 200 * time.Millisecond, MaxElapsed: 5 * time.Minute}
		// The breaker counts abandoned attempts: four blocked events open it.
		// A short open period keeps the test short; nothing else changes.
		cfg.Consumer.Breaker.OpenTimeout = time.Second
		// Parking off: the ledger's later events flow past its poisoned one.
		cfg.Consumer.Handlers = map[string]middleware.Config{r.ledger: {Ordered: new(true), Poison: middleware.PoisonConfig{Park: new(false)}}}
	})
	r.db = s.DB
	brokertest.Cleanup(t, kind, r.poolTopic, r.pool)
	brokertest.Cleanup(t, kind, r.ledgerTopic, r.ledger)
	r.schema = `"` + s.Config.Database.Schema + `"`
	_, err := r.db.Exec(`CREATE TABLE ` + r.schema + `.handled (
		seq BIGSERIAL PRIMARY KEY, handler TEXT NOT NULL, event_id TEXT NOT NULL, aggregate_id TEXT NOT NULL,
		blocked_one_poisoned BOOLEAN NOT NULL)`)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(r.logs.String())
		}
	})
	r.b = s.Open(t, bus.WithRegistry(r.reg), bus.WithLogger(r.logs.Slog()))
	r.stuck = &stuckHandlers{release: make(chan struct{}), calls: map[string]int{}}
	var releaseOnce sync.Once
	r.release = func() { releaseOnce.Do(func() { close(r.stuck.release) }) }
	t.Cleanup(r.release)
	return r
}

// handle is the handler name registers. Every handler writes a row in its
// transaction; a blocked one writes it too before it blocks, so a commit
// of an abandoned attempt would show. Each row records whether the
// ordered handler's blocked event (ledger-A-1) was poisoned when the row
// was written.
func (r *blockedRig) handle(name string) bus.HandlerFunc {
	return func(ctx context.Context, ev bus.Event) error {
		tx := bus.Tx[*sql.Tx](ctx)
		_, err := tx.ExecContext(ctx, `INSERT INTO `+r.schema+`.handled (handler, event_id, aggregate_id, blocked_one_poisoned)
			SELECT $1, $2, $3, EXISTS (SELECT 1 FROM `+r.schema+`.millrace_poison WHERE event_id = 'ledger-A-1')`,
			name, ev.ID, ev.AggregateID)
		if err != nil {
			return err
		}
		if ev.Type == blockedEvent {
			r.stuck.block(ev)
		}
		return nil
	}
}

// run registers both handlers and starts Run.
func (r *blockedRig) run() {
	require.NoError(r.t, r.b.Handle(r.poolTopic, r.pool, r.handle(r.pool)))
	require.NoError(r.t, r.b.Handle(r.ledgerTopic, r.ledger, r.handle(r.ledger)))
	r.running = testkit.Start(r.t, r.b.Run)
}

// publishBatch publishes the events of both handlers, some of them blocked.
func (r *blockedRig) publishBatch() {
	ctx := context.Background()
	require.NoError(r.t, r.b.PublishInOwnTx(ctx, r.poolTopic, r.poolEvents()...))
	require.NoError(r.t, r.b.PublishInOwnTx(ctx, r.ledgerTopic, r.ledgerEvents()...))
}

// poolEvents are the unordered handler's: 4 blocked events among 40
// others, 8 workers.
func (r *blockedRig) poolEvents() []bus.Event {
	var events []bus.Event
	for i := range 44 {
		ev := bus.Event{ID: fmt.Sprintf("pool-%02d", i), Type: "Healthy", AggregateType: "order",
			AggregateID: fmt.Sprintf("order-%02d", i), Payload: []byte(`{}`)}
		if i%11 == 0 {
			ev.Type = blockedEvent
			r.blocked = append(r.blocked, ev.ID)
		} else {
			r.healthy = append(r.healthy, ev.ID)
		}
		events = append(events, ev)
	}
	return events
}

// ledgerEvents are the ordered handler's: aggregate A's first event
// blocks; A's later events must wait for it, B..F's need not.
func (r *blockedRig) ledgerEvents() []bus.Event {
	var events []bus.Event
	for i := 1; i <= 3; i++ {
		for _, agg := range []string{"A", "B", "C", "D", "E", "F"} {
			ev := bus.Event{ID: fmt.Sprintf("ledger-%s-%d", agg, i), Type: "Healthy", AggregateType: "account",
				AggregateID: agg, AggregateVersion: int64(i), Payload: []byte(`{}`)}
			switch {
			case agg == "A" && i == 1:
				ev.Type = blockedEvent
				r.blocked = append(r.blocked, ev.ID)
			case agg == "A":
				r.aLater = append(r.aLater, ev.ID)
				r.healthy = append(r.healthy, ev.ID)
			default:
				r.others = append(r.others, ev.ID)
				r.healthy = append(r.healthy, ev.ID)
			}
			events = append(events, ev)
		}
	}
	return events
}

// count runs a count query.
func (r *blockedRig) count(query string, args ...any) int {
	r.t.Helper()
	var n int
	require.NoError(r.t, r.db.QueryRow(query, args...).Scan(&n))
	return n
}

// metric reads a consumer metric of handler (and outcome, where it has one).
func (r *blockedRig) metric(name, handler, outcome string) float64 {
	r.t.Helper()
	labels := map[string]string{"handler": handler}
	if outcome != "" {
		labels["outcome"] = outcome
	}
	return testkit.Metric(r.t, r.reg, name, labels)
}

// waitSettled waits until every healthy event was processed and every
// blocked one poisoned.
func (r *blockedRig) waitSettled() {
	healthyRows := `SELECT count(DISTINCT event_id) FROM ` + r.schema + `.handled WHERE event_id = ANY($1)`
	poisonRows := `SELECT count(*) FROM ` + r.schema + `.millrace_poison WHERE event_id = ANY($1)`
	deadline := time.Now().Add(4 * time.Minute)
	for r.count(healthyRows, r.healthy) < len(r.healthy) || r.count(poisonRows, r.blocked) < len(r.blocked) {
		require.True(r.t, time.Now().Before(deadline), "%s: %d of %d healthy events processed, %d of %d blocked ones poisoned",
			r.kind, r.count(healthyRows, r.healthy), len(r.healthy), r.count(poisonRows, r.blocked), len(r.blocked))
		time.Sleep(100 * time.Millisecond)
	}
}

// checkPoisoned: every other event exactly once; the blocked ones
// poisoned after their attempts, each abandoned at handler_timeout.
func (r *blockedRig) checkPoisoned() {
	t := r.t
	require.Zero(t, r.count(`SELECT count(*) FROM (SELECT event_id FROM `+r.schema+`.handled WHERE event_id = ANY($1)
		GROUP BY event_id HAVING count(*) <> 1) d`, r.healthy), "one effect per event")
	rows, err := r.db.Query(`SELECT event_id, handler, attempts, error_class, reason FROM ` + r.schema + `.millrace_poison`)
	require.NoError(t, err)
	poisoned := map[string]bool{}
	for rows.Next() {
		var id, handler, class, reason string
		var attempts int
		require.NoError(t, rows.Scan(&id, &handler, &attempts, &class, &reason))
		poisoned[id] = true
		require.True(t, strings.HasPrefix(handler, strings.SplitN(id, "-", 2)[0]+"-h-"), "%s poisoned by %s", id, handler)
		require.Equal(t, blockedAttempts, attempts, "%s: attempts == retry.max_attempts", id)
		require.Equal(t, middleware.ClassTransient, class)
		require.Contains(t, reason, fmt.Sprintf("attempt abandoned after handler_timeout (%s)", blockedTimeout), id)
		require.Equal(t, blockedAttempts, r.stuck.callsOf(id), "%s: one handler call per attempt", id)
	}
	require.NoError(t, rows.Err())
	require.Len(t, poisoned, len(r.blocked), "only the blocked events are poisoned")
	for _, id := range r.blocked {
		require.True(t, poisoned[id], id)
	}
}

// checkAbandonedMetrics: every attempt of a blocked event counts as
// abandoned, and all of them are still running.
func (r *blockedRig) checkAbandonedMetrics() {
	require.EqualValues(r.t, 4*blockedAttempts, r.metric(middleware.MetricAbandoned, r.pool, ""))
	require.EqualValues(r.t, blockedAttempts, r.metric(middleware.MetricAbandoned, r.ledger, ""))
	require.EqualValues(r.t, 4*blockedAttempts+blockedAttempts, r.abandonedRunning(),
		"the abandoned handlers are all still blocked")
}

// abandonedRunning is how many abandoned attempts of both handlers have
// not returned.
func (r *blockedRig) abandonedRunning() float64 {
	return r.metric(middleware.MetricAbandonedActive, r.pool, "") + r.metric(middleware.MetricAbandonedActive, r.ledger, "")
}

// checkOrder: aggregate A's later events ran only once its blocked event
// was poisoned. On Kafka the other aggregates' partitions are read
// independently of A's, so some of them were processed while A's event
// was still being retried; RabbitMQ and NATS deliver an ordered handler's
// events one at a time per process (middleware/README.md), so there they
// waited too.
func (r *blockedRig) checkOrder() {
	t := r.t
	require.Equal(t, len(r.aLater), r.count(`SELECT count(*) FROM `+r.schema+`.handled WHERE event_id = ANY($1) AND blocked_one_poisoned`, r.aLater))
	aOrder := testdb.Column[string](t, r.db, `SELECT event_id FROM `+r.schema+`.handled WHERE handler = $1 AND aggregate_id = 'A' ORDER BY seq`, r.ledger)
	require.Equal(t, []string{"ledger-A-2", "ledger-A-3"}, aOrder, "A's events in order (the blocked one's row rolled back)")
	if r.kind == bus.KindKafka {
		require.NotZero(t, r.count(`SELECT count(*) FROM `+r.schema+`.handled WHERE event_id = ANY($1) AND NOT blocked_one_poisoned`, r.others),
			"other aggregates flowed while A's blocked event was retried")
	}
}

// stopWithBlockedInFlight stops Run with one blocked event in flight per
// handler. Both are published at once, so that both are in their first
// attempt when the stop comes: waiting for one before publishing the
// other left the first one's attempt abandoned before the stop on a
// loaded machine, and on NATS an unordered handler then waits for its
// next attempt at the broker, not in flight.
func (r *blockedRig) stopWithBlockedInFlight() {
	t := r.t
	for _, p := range []struct{ topic, id string }{{r.poolTopic, "pool-stop"}, {r.ledgerTopic, "ledger-stop"}} {
		require.NoError(t, r.b.PublishInOwnTx(context.Background(), p.topic, bus.Event{ID: p.id, Type: blockedEvent,
			AggregateType: "order", AggregateID: p.id, Payload: []byte(`{}`)}))
	}
	testkit.Eventually(t, 2*time.Minute, "both stop events are in an attempt", func() bool {
		return r.stuck.callsOf("pool-stop") > 0 && r.stuck.callsOf("ledger-stop") > 0
	})
	stopped := time.Now()
	require.NoError(t, r.running.Stop(t, 5*time.Minute))
	// The promise: the consumer's side of Run returns within the longest
	// handler_timeout plus 10s (the router's CloseTimeout), however its
	// handlers block. It takes about handler_timeout.
	took := time.Since(stopped)
	t.Logf("%s: Run returned %s after the stop (handler_timeout %s)", r.kind, took.Round(time.Millisecond), blockedTimeout)
	require.Less(t, took, blockedTimeout+10*time.Second, "Run returns within handler_timeout + 10s")
	for _, h := range []string{r.pool, r.ledger} {
		require.EqualValues(t, 1, r.metric(middleware.MetricMessages, h, middleware.OutcomeNacked), "%s: the event in flight was nacked", h)
	}
	require.Equal(t, len(r.blocked), r.count(`SELECT count(*) FROM `+r.schema+`.millrace_poison`), "the stop poisoned nothing")
}

// checkAbandonedCommitNothing: the blocked handlers return long after
// their attempts were abandoned, and nothing they wrote commits.
func (r *blockedRig) checkAbandonedCommitNothing() {
	t := r.t
	r.release()
	testkit.Eventually(t, time.Minute, "every abandoned attempt finished", func() bool {
		return r.abandonedRunning() == 0
	})
	require.Zero(t, r.count(`SELECT count(*) FROM `+r.schema+`.handled WHERE event_id = ANY($1) OR event_id IN ('pool-stop', 'ledger-stop')`, r.blocked))
	abandoned := r.metric(middleware.MetricAbandoned, r.pool, "") + r.metric(middleware.MetricAbandoned, r.ledger, "")
	require.GreaterOrEqual(t, abandoned, float64(5*blockedAttempts+2), "the attempts in flight at the stop were abandoned too")
	require.EqualValues(t, abandoned, strings.Count(r.logs.String(), "An abandoned attempt finished; its result is dropped"),
		"every abandoned attempt's goroutine returned, and its result was dropped")
}
