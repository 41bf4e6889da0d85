package bus_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testlog"
	"github.com/millrace-io/millrace/middleware"
)

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
	suffix := testdb.UniqueName("")[2:]
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
	var aOrder []string
	aRows, err := r.db.Query(`SELECT event_id FROM `+r.schema+`.handled WHERE handler = $1 AND aggregate_id = 'A' ORDER BY seq`, r.ledger)
	require.NoError(t, err)
	for aRows.Next() {
		var id string
		require.NoError(t, aRows.Scan(&id))
		aOrder = append(aOrder, id)
	}
	require.NoError(t, aRows.Err())
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
