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
	suffix := testdb.UniqueName("")[2:]
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
