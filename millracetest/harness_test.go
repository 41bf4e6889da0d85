package millracetest_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/millracetest"
)

// fakeTB records what the harness reports instead of failing the test, so
// that a test can assert that the harness does fail a wrong handler.
type fakeTB struct {
	t      *testing.T
	mu     sync.Mutex
	errors []string
	fatal  string
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errors = append(f.errors, fmt.Sprintf(format, args...))
}

// Fatalf records the message and ends the goroutine, as testing.T does;
// run harness calls that may fatal through fakeTB.run.
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.fatal = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

func (f *fakeTB) Logf(format string, args ...any) { f.t.Logf(format, args...) }

// run calls fn on a goroutine of its own, so that a Fatalf ends only that.
func (f *fakeTB) run(fn func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	<-done
}

func (f *fakeTB) reported() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.errors...)
}

// service is one test's database schema with a business table: invoices,
// one row per invoice, no unique key, so a double effect is a second row.
type service struct {
	db     *sql.DB
	schema string
}

func newService(t *testing.T) *service {
	db := testdb.Open(t)
	s := &service{db: db, schema: testdb.Schema(t, db)}
	_, err := db.Exec(`CREATE TABLE ` + s.table("invoices") + ` (
		id BIGSERIAL PRIMARY KEY,
		order_id TEXT NOT NULL,
		event_id TEXT NOT NULL
	)`)
	require.NoError(t, err)
	return s
}

func (s *service) table(name string) string { return `"` + s.schema + `".` + name }

// inTx is a correct handler: its write is in the inbox transaction.
func (s *service) inTx(ctx context.Context, ev bus.Event) error {
	_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO `+s.table("invoices")+` (order_id, event_id) VALUES ($1, $2)`, ev.AggregateID, ev.ID)
	return err
}

// ownConnection is not idempotent outside the inbox: it writes on a
// connection of its own, which commits at once, whatever happens to the
// inbox transaction.
func (s *service) ownConnection(ctx context.Context, ev bus.Event) error {
	_, err := s.db.ExecContext(ctx, `INSERT INTO `+s.table("invoices")+` (order_id, event_id) VALUES ($1, $2)`, ev.AggregateID, ev.ID)
	return err
}

// invoices counts the invoices of one event.
func (s *service) invoices(ctx context.Context, tx *sql.Tx, ev bus.Event) (int, error) {
	var n int
	err := tx.QueryRowContext(ctx, `SELECT count(*) FROM `+s.table("invoices")+` WHERE event_id = $1`, ev.ID).Scan(&n)
	return n, err
}

func (s *service) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, s.db.QueryRow(query, args...).Scan(&n))
	return n
}

func order(id string) bus.Event {
	return bus.Event{Type: "OrderPlaced", AggregateType: "order", AggregateID: id, Payload: []byte(`{"order_id":"` + id + `"}`)}
}

func (s *service) harness(t millracetest.TB, handler bus.HandlerFunc, cfg bus.Config) *millracetest.Harness {
	return millracetest.New(t, millracetest.Options{
		DB: s.db, Schema: s.schema, Config: cfg, Topic: "orders.events", Group: "billing", Handler: handler,
	})
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// A handler whose write is in bus.Tx has one effect per event in every
// pattern, and each pattern delivers exactly as it says.
func TestHandlerInTxHasOneEffectInEveryPattern(t *testing.T) {
	t.Parallel()
	s := newService(t)
	h := s.harness(t, s.inTx, bus.Config{})

	delivered := h.Deliver(order("o-1"), order("o-2"))
	require.Len(t, delivered, 2)
	require.NotEmpty(t, delivered[0].ID)
	twice := h.DeliverTwice(order("o-3"))
	afterCommit := h.CrashAfterEffectBeforeAck(order("o-4"))
	beforeCommit := h.CrashBeforeCommit(order("o-5"))
	failedCommit := h.FailCommitOnce(order("o-6"))
	concurrent := h.DeliverConcurrently(order("o-7"), 4)

	for _, ev := range delivered {
		require.Equal(t, []string{middleware.OutcomeOK}, h.Outcomes(ev))
		require.Equal(t, 1, h.HandlerRuns(ev))
	}
	require.Equal(t, []string{middleware.OutcomeOK, middleware.OutcomeDuplicate}, h.Outcomes(twice))
	require.Equal(t, 1, h.HandlerRuns(twice))

	require.Equal(t, []string{middleware.OutcomeOK, middleware.OutcomeDuplicate}, h.Outcomes(afterCommit))
	require.Equal(t, 1, h.HandlerRuns(afterCommit))

	require.Equal(t, []string{millracetest.OutcomeCrashed, middleware.OutcomeOK}, h.Outcomes(beforeCommit))
	require.Equal(t, 2, h.HandlerRuns(beforeCommit), "the handler runs again after the crash")

	require.Equal(t, []string{middleware.OutcomeOK}, h.Outcomes(failedCommit))
	require.Equal(t, 2, h.HandlerRuns(failedCommit), "the chain retries the failed commit")

	require.Equal(t, []string{middleware.OutcomeDuplicate, middleware.OutcomeDuplicate, middleware.OutcomeDuplicate, middleware.OutcomeOK},
		sorted(h.Outcomes(concurrent)))
	require.Equal(t, 1, h.HandlerRuns(concurrent))

	// The crash patterns hand the redelivery to a restarted process, and
	// the ack of a crashed delivery never reached the broker.
	var byPattern = map[string][]millracetest.Delivery{}
	for _, d := range h.Deliveries() {
		byPattern[d.Pattern] = append(byPattern[d.Pattern], d)
	}
	for _, p := range []string{"CrashAfterEffectBeforeAck", "CrashBeforeCommit"} {
		ds := byPattern[p]
		require.Len(t, ds, 2, p)
		require.False(t, ds[0].Acked, p)
		require.True(t, ds[1].Acked, p)
		require.Greater(t, ds[1].Process, ds[0].Process, "%s: redelivered to a new process", p)
		require.Equal(t, []int{1, 2}, []int{ds[0].N, ds[1].N}, p)
	}
	require.Equal(t, 1, byPattern["FailCommitOnce"][0].Retries)

	require.True(t, h.AssertOnce(s.invoices))
	// Every event: one invoice, one inbox row, nothing poisoned.
	require.Equal(t, 7, s.count(t, `SELECT count(*) FROM `+s.table("invoices")))
	require.Equal(t, 7, s.count(t, `SELECT count(*) FROM `+s.table("millrace_inbox")+` WHERE consumer_group = 'billing'`))
	require.Zero(t, s.count(t, `SELECT count(*) FROM `+s.table("millrace_poison")))
	// The outbox keeps nothing of the harness's own publishing.
	require.Zero(t, s.count(t, `SELECT count(*) FROM `+s.table("watermill_millrace_outbox")))
}

// The same patterns, the same assertion: a handler whose write is in
// bus.Tx passes; one that writes on its own connection passes the
// patterns the inbox absorbs and fails those where a run is rolled back,
// and AssertOnce names the cause.
func TestAssertOnceFailsAHandlerWritingOutsideTx(t *testing.T) {
	t.Parallel()
	s := newService(t)
	for _, tc := range []struct {
		name    string
		handler bus.HandlerFunc
	}{
		{"in_tx", s.inTx},
		{"own_connection", s.ownConnection},
	} {
		fake := &fakeTB{t: t}
		var absorbed, rolledBack []bus.Event
		var absorbedOK, rolledBackOK bool
		var h *millracetest.Harness
		fake.run(func() {
			h = millracetest.New(fake, millracetest.Options{
				DB: s.db, Schema: s.schema, Topic: "orders.events", Group: "billing-" + tc.name, Handler: tc.handler,
			})
			absorbed = []bus.Event{
				h.Deliver(order("o-1"))[0],
				h.DeliverTwice(order("o-2")),
				h.CrashAfterEffectBeforeAck(order("o-3")),
				h.DeliverConcurrently(order("o-4"), 3),
			}
			absorbedOK = h.AssertOnce(s.invoices, absorbed...)
			rolledBack = []bus.Event{
				h.CrashBeforeCommit(order("o-5")),
				h.FailCommitOnce(order("o-6")),
			}
			rolledBackOK = h.AssertOnce(s.invoices, rolledBack...)
		})
		require.Empty(t, fake.fatal, tc.name)
		require.True(t, absorbedOK, "%s: the inbox absorbs duplicates whatever the handler does", tc.name)
		errs := fake.reported()
		if tc.name == "in_tx" {
			require.True(t, rolledBackOK)
			require.Empty(t, errs)
			continue
		}
		require.False(t, rolledBackOK)
		require.Len(t, errs, 2, "one report per failing event")
		for i, ev := range rolledBack {
			require.Contains(t, errs[i], "event "+ev.ID+" (OrderPlaced of order "+ev.AggregateID+"): 2 effects, want exactly 1")
			require.Contains(t, errs[i], "The handler ran 2 times: 1 run committed, 1 was rolled back, undoing what it wrote in bus.Tx. Yet 2 effects remain")
			require.Contains(t, errs[i], "effects outside bus.Tx")
			require.Equal(t, 2, h.Effects(s.invoices, ev))
		}
		require.Contains(t, errs[0], "crashed, handler ran 1 time, not acked")
		require.Contains(t, errs[1], "ok, handler ran 2 times, 1 retry, acked")
		t.Logf("what AssertOnce reports:\n%s", strings.Join(errs, "\n"))
	}
}

// status is a projection: the latest status of each order, set by the
// handler from the event's payload (state, not a delta).
func (s *service) createStatus(t *testing.T) {
	_, err := s.db.Exec(`CREATE TABLE ` + s.table("order_status") + ` (order_id TEXT PRIMARY KEY, status TEXT NOT NULL, version BIGINT NOT NULL)`)
	require.NoError(t, err)
}

func (s *service) setStatus(ctx context.Context, ev bus.Event) error {
	_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO `+s.table("order_status")+` (order_id, status, version)
		VALUES ($1, $2::jsonb->>'status', $3)
		ON CONFLICT (order_id) DO UPDATE SET status = EXCLUDED.status, version = EXCLUDED.version`,
		ev.AggregateID, string(ev.Payload), ev.AggregateVersion)
	return err
}

func statusEvent(orderID, status string, version int64) bus.Event {
	return bus.Event{Type: "OrderStatusChanged", AggregateType: "order", AggregateID: orderID, AggregateVersion: version,
		Payload: []byte(`{"status":"` + status + `"}`)}
}

// Reordered deliveries: with the ordering guard the older version is
// dropped as stale and the newest status stays; without it the older one
// overwrites the newer, and the harness shows it.
func TestReorderWithAndWithoutOrderingGuard(t *testing.T) {
	t.Parallel()
	s := newService(t)
	s.createStatus(t)
	for _, guard := range []bool{true, false} {
		name := fmt.Sprintf("guard_%t", guard)
		var cfg bus.Config
		cfg.Consumer.OrderingGuard = &guard
		h := millracetest.New(t, millracetest.Options{DB: s.db, Schema: s.schema, Config: cfg, Topic: "orders.events", Group: "status-" + name, Handler: s.setStatus})
		orderID := "o-" + name
		evs := h.Reorder(statusEvent(orderID, "placed", 1), statusEvent(orderID, "paid", 2), statusEvent(orderID, "shipped", 3))
		var status string
		var version int64
		require.NoError(t, s.db.QueryRow(`SELECT status, version FROM `+s.table("order_status")+` WHERE order_id = $1`, orderID).Scan(&status, &version))
		ds := h.Deliveries()
		require.Len(t, ds, 3)
		require.Equal(t, []string{evs[2].ID, evs[1].ID, evs[0].ID}, []string{ds[0].EventID, ds[1].EventID, ds[2].EventID}, "delivered newest first")
		if guard {
			require.Equal(t, "shipped", status, name)
			require.EqualValues(t, 3, version)
			require.Equal(t, []string{middleware.OutcomeOK}, h.Outcomes(evs[2]))
			require.Equal(t, []string{middleware.OutcomeStale}, h.Outcomes(evs[1]))
			require.Equal(t, []string{middleware.OutcomeStale}, h.Outcomes(evs[0]))
			require.Zero(t, h.HandlerRuns(evs[0]), "a stale event does not reach the handler")
		} else {
			require.Equal(t, "placed", status, "%s: the oldest event, delivered last, wins", name)
			require.EqualValues(t, 1, version)
			for _, ev := range evs {
				require.Equal(t, []string{middleware.OutcomeOK}, h.Outcomes(ev))
			}
		}
	}

	// AssertOnce explains a stale event's missing effect.
	fake := &fakeTB{t: t}
	s2 := newService(t)
	s2.createStatus(t)
	var cfg bus.Config
	cfg.Consumer.OrderingGuard = new(true)
	fake.run(func() {
		h := millracetest.New(fake, millracetest.Options{DB: s2.db, Schema: s2.schema, Config: cfg, Topic: "orders.events", Group: "status", Handler: s2.setStatus})
		evs := h.Reorder(statusEvent("o-1", "placed", 1), statusEvent("o-1", "paid", 2))
		h.AssertOnce(func(ctx context.Context, tx *sql.Tx, ev bus.Event) (int, error) {
			var n int
			err := tx.QueryRowContext(ctx, `SELECT count(*) FROM `+s2.table("order_status")+` WHERE order_id = $1 AND version = $2`, ev.AggregateID, ev.AggregateVersion).Scan(&n)
			return n, err
		}, evs...)
	})
	require.Empty(t, fake.fatal)
	errs := fake.reported()
	require.Len(t, errs, 1)
	require.Contains(t, errs[0], "0 effects, want exactly 1")
	require.Contains(t, errs[0], "stale, handler ran 0 times, acked")
	require.Contains(t, errs[0], "The ordering guard dropped it as stale: version 1 of order o-1 is not newer than the version consumer group status had already applied.")
}

// With the inbox off nothing deduplicates: a duplicate delivery runs the
// handler again, and AssertOnce says why.
func TestInboxOffShowsDuplicateEffects(t *testing.T) {
	t.Parallel()
	s := newService(t)
	var cfg bus.Config
	cfg.Consumer.Inbox.Enabled = new(false)
	cfg.Consumer.OrderingGuard = new(true) // keeps a transaction for bus.Tx
	fake := &fakeTB{t: t}
	var ev bus.Event
	fake.run(func() {
		h := s.harness(fake, s.inTx, cfg)
		ev = h.DeliverTwice(order("o-1"))
		h.AssertOnce(s.invoices)
	})
	require.Empty(t, fake.fatal)
	errs := fake.reported()
	require.Len(t, errs, 1)
	require.Contains(t, errs[0], "event "+ev.ID)
	require.Contains(t, errs[0], "2 effects, want exactly 1")
	require.Contains(t, errs[0], "consumer.inbox.enabled is false for handler billing")
	require.Zero(t, s.count(t, `SELECT count(*) FROM `+s.table("millrace_inbox")))
}

// A failing handler is poisoned through the real poison stage: at once for
// a permanent error, after retry.max_attempts for a transient one; the
// explanation carries the stored reason. Both poison destinations.
func TestPoisonedEventsAreExplained(t *testing.T) {
	t.Parallel()
	for _, destination := range []string{middleware.PoisonToTable, middleware.PoisonToTopic} {
		t.Run(destination, func(t *testing.T) {
			t.Parallel()
			s := newService(t)
			var cfg bus.Config
			cfg.Consumer.Poison.Destination = destination
			cfg.Consumer.Poison.Topic = "orders.poison"
			cfg.Consumer.Retry.MaxAttempts = 3
			handler := func(ctx context.Context, ev bus.Event) error {
				if ev.AggregateID == "unknown-customer" {
					return bus.Permanent(errors.New("customer c-9 does not exist"))
				}
				return errors.New("payment service unavailable")
			}
			fake := &fakeTB{t: t}
			var h *millracetest.Harness
			var permanent, transient bus.Event
			fake.run(func() {
				h = s.harness(fake, handler, cfg)
				permanent = h.Deliver(order("unknown-customer"))[0]
				transient = h.CrashBeforeCommit(order("o-2"))
				h.AssertOnce(s.invoices)
			})
			require.Empty(t, fake.fatal)
			require.Equal(t, []string{middleware.OutcomePoisoned}, h.Outcomes(permanent))
			require.Equal(t, 1, h.HandlerRuns(permanent))
			// The crash takes the first run; the restarted process tries
			// retry.max_attempts times and poisons it.
			require.Equal(t, []string{millracetest.OutcomeCrashed, middleware.OutcomePoisoned}, h.Outcomes(transient))
			require.Equal(t, 1+3, h.HandlerRuns(transient))
			require.Equal(t, 2, h.Deliveries()[2].Retries)

			errs := fake.reported()
			require.Len(t, errs, 2)
			require.Contains(t, errs[0], "It was poisoned: ")
			require.Contains(t, errs[0], "customer c-9 does not exist")
			require.Contains(t, errs[1], "It was poisoned: ")
			require.Contains(t, errs[1], "payment service unavailable")
			if destination == middleware.PoisonToTable {
				require.Equal(t, 2, s.count(t, `SELECT count(*) FROM `+s.table("millrace_poison")+` WHERE consumer_group = 'billing'`))
			} else {
				require.Zero(t, s.count(t, `SELECT count(*) FROM `+s.table("millrace_poison")))
			}
		})
	}
}

// Follow-up events published in bus.Tx are effects like any other: one
// per event through a crash before the commit, with the event as causation.
func TestFollowUpEventsThroughCrashes(t *testing.T) {
	t.Parallel()
	s := newService(t)
	ctx := context.Background()
	var cfg bus.Config
	cfg.Database.Schema = s.schema
	cfg.Broker.NATS.URL = "nats://127.0.0.1:4222" // never dialed: this Bus only publishes into the outbox
	require.NoError(t, bus.Migrate(ctx, s.db, cfg))
	b, err := bus.Open(ctx, cfg, s.db)
	require.NoError(t, err)
	defer b.Close()
	handler := func(ctx context.Context, ev bus.Event) error {
		if err := s.inTx(ctx, ev); err != nil {
			return err
		}
		return b.Publish(ctx, bus.Tx[bus.Execer](ctx), "invoices.events", bus.Event{
			Type: "InvoiceIssued", AggregateType: "invoice", AggregateID: ev.AggregateID, Payload: []byte(`{}`),
		})
	}
	h := s.harness(t, handler, cfg)
	evs := []bus.Event{
		h.CrashBeforeCommit(order("o-1")),
		h.CrashAfterEffectBeforeAck(order("o-2")),
		h.FailCommitOnce(order("o-3")),
	}
	followUps := func(ctx context.Context, tx *sql.Tx, ev bus.Event) (int, error) {
		var n int
		err := tx.QueryRowContext(ctx, `SELECT count(*) FROM `+s.table("watermill_millrace_outbox")+
			` WHERE payload::jsonb -> 'metadata' ->> $1 = $2`, bus.CausationIDKey, ev.ID).Scan(&n)
		return n, err
	}
	require.True(t, h.AssertOnce(followUps, evs...))
	require.True(t, h.AssertOnce(s.invoices, evs...))
	require.Equal(t, 3, s.count(t, `SELECT count(*) FROM `+s.table("watermill_millrace_outbox")))
}

// Delivering an event the harness returned delivers the same event again:
// the inbox has it, the handler does not run, and there is nothing to crash.
func TestReturnedEventsAreDeliveredAgain(t *testing.T) {
	t.Parallel()
	s := newService(t)
	h := s.harness(t, s.inTx, bus.Config{})
	ev := h.Deliver(order("o-1"))[0]
	again := h.CrashBeforeCommit(ev)
	require.Equal(t, ev.ID, again.ID)
	require.Equal(t, []string{middleware.OutcomeOK, middleware.OutcomeDuplicate}, h.Outcomes(ev))
	require.Equal(t, 1, h.HandlerRuns(ev))
	require.True(t, h.AssertOnce(s.invoices))

	fresh := h.Deliver(order("o-1"))[0]
	require.NotEqual(t, ev.ID, fresh.ID, "an event without an id gets a new one")
}

// Misuse fails the test at once, naming what is wrong.
func TestMisuseIsReported(t *testing.T) {
	t.Parallel()
	s := newService(t)
	for _, tc := range []struct {
		name string
		run  func(fake *fakeTB)
		want []string
	}{
		{"no options", func(fake *fakeTB) { millracetest.New(fake, millracetest.Options{}) }, []string{
			"Options.DB is required", "Options.Topic is required", "Options.Name or Options.Group is required", "Options.Handler is required",
		}},
		{"bad consumer config", func(fake *fakeTB) {
			var cfg bus.Config
			cfg.Consumer.Retry.MaxAttempts = -1
			s.harness(fake, s.inTx, cfg)
		}, []string{"millracetest.New: Options.Config: invalid millrace config", "consumer.retry.max_attempts: must be greater than 0; got -1"}},
		{"bad group", func(fake *fakeTB) {
			millracetest.New(fake, millracetest.Options{DB: s.db, Schema: s.schema, Topic: "orders.events", Group: "bill ing", Handler: s.inTx})
		}, []string{"consumer group", `"bill ing"`}},
		{"event refused by Publish", func(fake *fakeTB) {
			s.harness(fake, s.inTx, bus.Config{}).Deliver(bus.Event{Type: "OrderPlaced", AggregateType: "order", Payload: []byte(`{}`)})
		}, []string{"bus.Publish refused the events", "AggregateID"}},
		{"payload not JSON", func(fake *fakeTB) {
			s.harness(fake, s.inTx, bus.Config{}).DeliverTwice(bus.Event{Type: "OrderPlaced", AggregateType: "order", AggregateID: "o-1", Payload: []byte(`{`)})
		}, []string{"bus.Publish refused the events", "not valid JSON"}},
		{"event without id", func(fake *fakeTB) {
			s.harness(fake, s.inTx, bus.Config{}).AssertOnce(s.invoices, order("o-1"))
		}, []string{"has no ID: pass the events the harness returned"}},
		{"one copy", func(fake *fakeTB) { s.harness(fake, s.inTx, bus.Config{}).DeliverConcurrently(order("o-1"), 1) }, []string{"copies must be at least 2; got 1"}},
	} {
		fake := &fakeTB{t: t}
		fake.run(func() { tc.run(fake) })
		for _, w := range tc.want {
			require.Contains(t, fake.fatal, w, tc.name)
		}
	}
}

// The harness shortens the retry waits and the breaker's open timeout,
// including in the handler's override, unless RealTimings; the semantics
// (attempts, inbox, guard) are the configured ones.
func TestTimings(t *testing.T) {
	t.Parallel()
	s := newService(t)
	var cfg bus.Config
	cfg.Consumer.Retry.MaxAttempts = 7
	cfg.Consumer.Handlers = map[string]middleware.Config{
		"billing": {Retry: middleware.RetryConfig{InitialInterval: 2 * time.Second, MaxInterval: 5 * time.Second}},
		// Valid as configured, invalid merged onto shortened defaults: the
		// harness drops the overrides of other handlers.
		"shipping": {Retry: middleware.RetryConfig{InitialInterval: 5 * time.Second}},
	}
	short := s.harness(t, s.inTx, cfg).Config().Consumer.For("billing")
	require.Equal(t, time.Millisecond, short.Retry.InitialInterval)
	require.Equal(t, time.Millisecond, short.Retry.MaxInterval)
	require.Equal(t, 10*time.Millisecond, short.Breaker.OpenTimeout)
	require.Equal(t, 7, short.Retry.MaxAttempts)
	require.Len(t, cfg.Consumer.Handlers, 2, "the caller's config is not changed")

	real := millracetest.New(t, millracetest.Options{DB: s.db, Schema: s.schema, Config: cfg, Topic: "orders.events", Group: "billing-real", Name: "billing", Handler: s.inTx, RealTimings: true}).
		Config().Consumer.For("billing")
	require.Equal(t, 2*time.Second, real.Retry.InitialInterval)
	require.Equal(t, middleware.DefaultOpenTimeout, real.Breaker.OpenTimeout)
}
