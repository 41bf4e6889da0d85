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
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			testBlockedHandlers(t, kind)
		})
	}
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

func testBlockedHandlers(t *testing.T, kind string) {
	ctx := context.Background()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, kind, &cfg)
	const handlerTimeout, maxAttempts = 2 * time.Second, 3
	cfg.Consumer.Workers = 8
	cfg.Consumer.HandlerTimeout = handlerTimeout
	cfg.Consumer.Retry = middleware.RetryConfig{MaxAttempts: maxAttempts, InitialInterval: 50 * time.Millisecond,
		MaxInterval: 200 * time.Millisecond, MaxElapsed: 5 * time.Minute}
	// The breaker counts abandoned attempts: four blocked events open it.
	// A short open period keeps the test short; nothing else changes.
	cfg.Consumer.Breaker.OpenTimeout = time.Second
	suffix := testdb.UniqueName("")[2:]
	poolTopic, pool := "pool-"+suffix, "pool-h-"+suffix
	ledgerTopic, ledger := "ledger-"+suffix, "ledger-h-"+suffix
	cfg.Consumer.Handlers = map[string]middleware.Config{ledger: {Ordered: new(true)}}
	brokertest.Cleanup(t, kind, poolTopic, pool)
	brokertest.Cleanup(t, kind, ledgerTopic, ledger)
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	schema := `"` + cfg.Database.Schema + `"`
	_, err := db.Exec(`CREATE TABLE ` + schema + `.handled (
		seq BIGSERIAL PRIMARY KEY, handler TEXT NOT NULL, event_id TEXT NOT NULL, aggregate_id TEXT NOT NULL,
		blocked_one_poisoned BOOLEAN NOT NULL)`)
	require.NoError(t, err)

	reg := prometheus.NewRegistry()
	var logs testlog.Buffer
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(logs.String())
		}
	})
	b, err := bus.Open(ctx, cfg, db, bus.WithRegistry(reg), bus.WithLogger(logs.Slog()))
	require.NoError(t, err)
	defer b.Close()

	stuck := &stuckHandlers{release: make(chan struct{}), calls: map[string]int{}}
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(stuck.release) }) }
	defer release()
	// Every handler writes a row in its transaction; a blocked one writes it
	// too before it blocks, so a commit of an abandoned attempt would show.
	// Each row records whether the ordered handler's blocked event
	// (ledger-A-1) was poisoned when the row was written.
	handle := func(name string) bus.HandlerFunc {
		return func(ctx context.Context, ev bus.Event) error {
			tx := bus.Tx[*sql.Tx](ctx)
			_, err := tx.ExecContext(ctx, `INSERT INTO `+schema+`.handled (handler, event_id, aggregate_id, blocked_one_poisoned)
				SELECT $1, $2, $3, EXISTS (SELECT 1 FROM `+schema+`.millrace_poison WHERE event_id = 'ledger-A-1')`,
				name, ev.ID, ev.AggregateID)
			if err != nil {
				return err
			}
			if ev.Type == blockedEvent {
				stuck.block(ev)
			}
			return nil
		}
	}
	require.NoError(t, b.Handle(poolTopic, pool, handle(pool)))
	require.NoError(t, b.Handle(ledgerTopic, ledger, handle(ledger)))
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()

	// The unordered handler: 4 blocked events among 40 others, 8 workers.
	var poolEvents []bus.Event
	var blocked, healthy []string
	for i := range 44 {
		ev := bus.Event{ID: fmt.Sprintf("pool-%02d", i), Type: "Healthy", AggregateType: "order",
			AggregateID: fmt.Sprintf("order-%02d", i), Payload: []byte(`{}`)}
		if i%11 == 0 {
			ev.Type = blockedEvent
			blocked = append(blocked, ev.ID)
		} else {
			healthy = append(healthy, ev.ID)
		}
		poolEvents = append(poolEvents, ev)
	}
	// The ordered handler: aggregate A's first event blocks; A's later
	// events must wait for it, B..F's need not.
	var ledgerEvents []bus.Event
	var aLater, others []string
	for i := 1; i <= 3; i++ {
		for _, agg := range []string{"A", "B", "C", "D", "E", "F"} {
			ev := bus.Event{ID: fmt.Sprintf("ledger-%s-%d", agg, i), Type: "Healthy", AggregateType: "account",
				AggregateID: agg, AggregateVersion: int64(i), Payload: []byte(`{}`)}
			switch {
			case agg == "A" && i == 1:
				ev.Type = blockedEvent
				blocked = append(blocked, ev.ID)
			case agg == "A":
				aLater = append(aLater, ev.ID)
				healthy = append(healthy, ev.ID)
			default:
				others = append(others, ev.ID)
				healthy = append(healthy, ev.ID)
			}
			ledgerEvents = append(ledgerEvents, ev)
		}
	}
	require.NoError(t, b.PublishInOwnTx(ctx, poolTopic, poolEvents...))
	require.NoError(t, b.PublishInOwnTx(ctx, ledgerTopic, ledgerEvents...))

	count := func(query string, args ...any) int {
		t.Helper()
		var n int
		require.NoError(t, db.QueryRow(query, args...).Scan(&n))
		return n
	}
	healthyRows := `SELECT count(DISTINCT event_id) FROM ` + schema + `.handled WHERE event_id = ANY($1)`
	poisonRows := `SELECT count(*) FROM ` + schema + `.millrace_poison WHERE event_id = ANY($1)`
	deadline := time.Now().Add(4 * time.Minute)
	for count(healthyRows, healthy) < len(healthy) || count(poisonRows, blocked) < len(blocked) {
		require.True(t, time.Now().Before(deadline), "%s: %d of %d healthy events processed, %d of %d blocked ones poisoned",
			kind, count(healthyRows, healthy), len(healthy), count(poisonRows, blocked), len(blocked))
		time.Sleep(100 * time.Millisecond)
	}

	// Every other event exactly once; the blocked ones poisoned after their
	// attempts, each abandoned at handler_timeout.
	require.Zero(t, count(`SELECT count(*) FROM (SELECT event_id FROM `+schema+`.handled WHERE event_id = ANY($1)
		GROUP BY event_id HAVING count(*) <> 1) d`, healthy), "one effect per event")
	rows, err := db.Query(`SELECT event_id, handler, attempts, error_class, reason FROM ` + schema + `.millrace_poison`)
	require.NoError(t, err)
	poisoned := map[string]bool{}
	for rows.Next() {
		var id, handler, class, reason string
		var attempts int
		require.NoError(t, rows.Scan(&id, &handler, &attempts, &class, &reason))
		poisoned[id] = true
		require.True(t, strings.HasPrefix(handler, strings.SplitN(id, "-", 2)[0]+"-h-"), "%s poisoned by %s", id, handler)
		require.Equal(t, maxAttempts, attempts, "%s: attempts == retry.max_attempts", id)
		require.Equal(t, middleware.ClassTransient, class)
		require.Contains(t, reason, fmt.Sprintf("attempt abandoned after handler_timeout (%s)", handlerTimeout), id)
		require.Equal(t, maxAttempts, stuck.callsOf(id), "%s: one handler call per attempt", id)
	}
	require.NoError(t, rows.Err())
	require.Len(t, poisoned, len(blocked), "only the blocked events are poisoned")
	for _, id := range blocked {
		require.True(t, poisoned[id], id)
	}
	metric := func(name, handler, outcome string) float64 {
		t.Helper()
		families, err := reg.Gather()
		require.NoError(t, err)
		for _, f := range families {
			if f.GetName() != name {
				continue
			}
		next:
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					if (l.GetName() == "handler" && l.GetValue() != handler) || (l.GetName() == "outcome" && l.GetValue() != outcome) {
						continue next
					}
				}
				if m.Counter != nil {
					return m.GetCounter().GetValue()
				}
				return m.GetGauge().GetValue()
			}
		}
		return 0
	}
	require.EqualValues(t, 4*maxAttempts, metric(middleware.MetricAbandoned, pool, ""))
	require.EqualValues(t, maxAttempts, metric(middleware.MetricAbandoned, ledger, ""))
	require.EqualValues(t, 4*maxAttempts+maxAttempts, metric(middleware.MetricAbandonedActive, pool, "")+metric(middleware.MetricAbandonedActive, ledger, ""),
		"the abandoned handlers are all still blocked")

	// Order: aggregate A's later events ran only once its blocked event was
	// poisoned. On Kafka the other aggregates' partitions are read
	// independently of A's, so some of them were processed while A's event
	// was still being retried; RabbitMQ and NATS deliver an ordered
	// handler's events one at a time per process (middleware/README.md), so
	// there they waited too.
	require.Equal(t, len(aLater), count(`SELECT count(*) FROM `+schema+`.handled WHERE event_id = ANY($1) AND blocked_one_poisoned`, aLater))
	var aOrder []string
	aRows, err := db.Query(`SELECT event_id FROM `+schema+`.handled WHERE handler = $1 AND aggregate_id = 'A' ORDER BY seq`, ledger)
	require.NoError(t, err)
	for aRows.Next() {
		var id string
		require.NoError(t, aRows.Scan(&id))
		aOrder = append(aOrder, id)
	}
	require.NoError(t, aRows.Err())
	require.Equal(t, []string{"ledger-A-2", "ledger-A-3"}, aOrder, "A's events in order (the blocked one's row rolled back)")
	if kind == bus.KindKafka {
		require.NotZero(t, count(`SELECT count(*) FROM `+schema+`.handled WHERE event_id = ANY($1) AND NOT blocked_one_poisoned`, others),
			"other aggregates flowed while A's blocked event was retried")
	}

	// The stop: one blocked event in flight per handler. Both are published
	// at once, so that both are in their first attempt when the stop comes:
	// waiting for one before publishing the other left the first one's
	// attempt abandoned before the stop on a loaded machine, and on NATS an
	// unordered handler then waits for its next attempt at the broker, not
	// in flight.
	for _, p := range []struct{ topic, id string }{{poolTopic, "pool-stop"}, {ledgerTopic, "ledger-stop"}} {
		require.NoError(t, b.PublishInOwnTx(ctx, p.topic, bus.Event{ID: p.id, Type: blockedEvent, AggregateType: "order",
			AggregateID: p.id, Payload: []byte(`{}`)}))
	}
	testkit.Eventually(t, 2*time.Minute, "both stop events are in an attempt", func() bool {
		return stuck.callsOf("pool-stop") > 0 && stuck.callsOf("ledger-stop") > 0
	})
	stopped := time.Now()
	stop()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(5 * time.Minute):
		t.Fatal("Run did not return after its context was cancelled")
	}
	// The promise: the consumer's side of Run returns within the longest
	// handler_timeout plus 10s (the router's CloseTimeout), however its
	// handlers block. It takes about handler_timeout.
	took := time.Since(stopped)
	t.Logf("%s: Run returned %s after the stop (handler_timeout %s)", kind, took.Round(time.Millisecond), handlerTimeout)
	require.Less(t, took, handlerTimeout+10*time.Second, "Run returns within handler_timeout + 10s")
	for _, h := range []string{pool, ledger} {
		require.EqualValues(t, 1, metric(middleware.MetricMessages, h, middleware.OutcomeNacked), "%s: the event in flight was nacked", h)
	}
	require.Equal(t, len(blocked), count(`SELECT count(*) FROM `+schema+`.millrace_poison`), "the stop poisoned nothing")

	// The blocked handlers return long after their attempts were abandoned:
	// nothing they wrote commits.
	release()
	testkit.Eventually(t, time.Minute, "every abandoned attempt finished", func() bool {
		return metric(middleware.MetricAbandonedActive, pool, "")+metric(middleware.MetricAbandonedActive, ledger, "") == 0
	})
	require.Zero(t, count(`SELECT count(*) FROM `+schema+`.handled WHERE event_id = ANY($1) OR event_id IN ('pool-stop', 'ledger-stop')`, blocked))
	abandoned := metric(middleware.MetricAbandoned, pool, "") + metric(middleware.MetricAbandoned, ledger, "")
	require.GreaterOrEqual(t, abandoned, float64(5*maxAttempts+2), "the attempts in flight at the stop were abandoned too")
	require.EqualValues(t, abandoned, strings.Count(logs.String(), "An abandoned attempt finished; its result is dropped"),
		"every abandoned attempt's goroutine returned, and its result was dropped")
}
