package bus_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

// The same service code runs on each broker; only broker.kind changes.
func TestServiceRunsOnEveryBroker(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testServiceRoundTrip)
}

// kindRig is what the rigs of the tests on every broker kind start from:
// the test, the broker kind and the service's database.
type kindRig struct {
	t    *testing.T
	kind string
	db   *sql.DB
}

type audited struct {
	ev      bus.Event
	traceID trace.TraceID
}

// roundTrip is one broker's service: billing writes an invoice and
// publishes InvoiceIssued in the inbox transaction; audit records what
// arrives.
type roundTrip struct {
	kindRig
	schema           string
	tp               *sdktrace.TracerProvider
	b                *bus.Bus
	orders, invoices string
	billing, audit   string
	mu               sync.Mutex
	seen             []audited
	published        map[string]trace.TraceID // order aggregate id -> trace of its publishing span
}

// roundTripOrders is how many orders a round trip publishes.
const roundTripOrders = 30

func testServiceRoundTrip(t *testing.T, kind string) {
	r := newRoundTrip(t, kind)
	r.run()
	r.publishOrders()
	r.waitAudited()
	r.checkInvoices()
	r.checkCausationAndTrace()
}

// newRoundTrip opens a traced service on kind with an invoices table.
func newRoundTrip(t *testing.T, kind string) *roundTrip {
	s := brokertest.NewService(t, kind, func(c *bus.Config) { c.Consumer.HandlerTimeout = 10 * time.Second })
	suffix := "_" + testkit.Suffix()
	r := &roundTrip{kindRig: kindRig{t, kind, s.DB}, schema: s.Config.Database.Schema, published: map[string]trace.TraceID{},
		orders: "orders-" + suffix, invoices: "invoices-" + suffix, billing: "billing-" + suffix, audit: "audit-" + suffix}
	brokertest.Cleanup(t, kind, r.orders, r.billing)
	brokertest.Cleanup(t, kind, r.invoices, r.audit)
	_, err := s.DB.Exec(`CREATE TABLE ` + s.Table("invoices") + ` (order_id text PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)
	r.tp = sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = r.tp.Shutdown(context.Background()) })
	r.b = s.Open(t, bus.WithTracerProvider(r.tp))
	return r
}

// run registers billing and audit and runs the service; its Run must
// return without error within 60s of the end of the test.
func (r *roundTrip) run() {
	r.handle()
	running := testkit.Start(r.t, r.b.Run)
	r.t.Cleanup(func() { require.NoError(r.t, running.Stop(r.t, 60*time.Second)) })
}

// handle registers billing and audit.
func (r *roundTrip) handle() {
	require.NoError(r.t, r.b.Handle(r.orders, r.billing, func(ctx context.Context, ev bus.Event) error {
		tx := bus.Tx[*sql.Tx](ctx)
		if _, err := tx.ExecContext(ctx, `INSERT INTO "`+r.schema+`".invoices VALUES ($1, $2)`, ev.AggregateID, ev.ID); err != nil {
			return err
		}
		return r.b.Publish(ctx, tx, r.invoices, bus.Event{Type: "InvoiceIssued", AggregateType: "invoice", AggregateID: ev.AggregateID, Payload: []byte(`{}`)})
	}))
	require.NoError(r.t, r.b.Handle(r.invoices, r.audit, func(ctx context.Context, ev bus.Event) error {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.seen = append(r.seen, audited{ev: ev, traceID: trace.SpanContextFromContext(ctx).TraceID()})
		return nil
	}))
}

// publishOrders publishes each order in its own transaction and span.
func (r *roundTrip) publishOrders() {
	t, ctx := r.t, context.Background()
	tracer := r.tp.Tracer("test")
	for i := range roundTripOrders {
		spanCtx, span := tracer.Start(ctx, "create order")
		id := fmt.Sprintf("ord-%d", i)
		tx, err := r.db.BeginTx(spanCtx, nil)
		require.NoError(t, err)
		require.NoError(t, r.b.Publish(spanCtx, tx, r.orders, bus.Event{Type: "OrderCreated", AggregateType: "order", AggregateID: id, Payload: []byte(`{"id":"` + id + `"}`)}))
		require.NoError(t, tx.Commit())
		span.End()
		r.published[id] = span.SpanContext().TraceID()
	}
}

// waitAudited waits until every order's follow-up reached audit.
func (r *roundTrip) waitAudited() {
	deadline := time.Now().Add(90 * time.Second)
	for {
		r.mu.Lock()
		got := len(r.seen)
		r.mu.Unlock()
		if got >= roundTripOrders {
			break
		}
		require.True(r.t, time.Now().Before(deadline), "%s: %d of %d follow-up events arrived", r.kind, got, roundTripOrders)
		time.Sleep(20 * time.Millisecond)
	}
}

// checkInvoices: one invoice and one inbox row per order.
func (r *roundTrip) checkInvoices() {
	t := r.t
	var invoicesCount, inboxRows int
	require.NoError(t, r.db.QueryRow(`SELECT count(*) FROM "`+r.schema+`".invoices`).Scan(&invoicesCount))
	require.NoError(t, r.db.QueryRow(`SELECT count(*) FROM "`+r.schema+`".millrace_inbox WHERE consumer_group = $1`, r.billing).Scan(&inboxRows))
	require.Equal(t, roundTripOrders, invoicesCount)
	require.Equal(t, roundTripOrders, inboxRows)
}

// checkCausationAndTrace: each follow-up is caused and correlated by its
// order event, in the trace of the order's publish.
func (r *roundTrip) checkCausationAndTrace() {
	t := r.t
	r.mu.Lock()
	defer r.mu.Unlock()
	byOrder := map[string]audited{}
	for _, a := range r.seen {
		byOrder[a.ev.AggregateID] = a
	}
	require.Len(t, byOrder, roundTripOrders)
	for id, traceID := range r.published {
		a := byOrder[id]
		var orderEventID string
		require.NoError(t, r.db.QueryRow(`SELECT event_id FROM "`+r.schema+`".invoices WHERE order_id = $1`, id).Scan(&orderEventID))
		require.Equal(t, orderEventID, a.ev.CausationID, "the follow-up's causation is the order event")
		require.Equal(t, orderEventID, a.ev.CorrelationID, "the flow is correlated by its first event")
		require.Equal(t, traceID, a.traceID, "one trace from the order's publish to the audit handler")
	}
}

// deadlineCtx is a context whose deadline passes when the test calls
// expire, not at a time a slow machine might reach before Run is up: its
// Err is then context.DeadlineExceeded, as a context.WithDeadline's is,
// and every context derived from it ends the same way.
type deadlineCtx struct {
	context.Context
	done chan struct{}
	once sync.Once
}

func newDeadlineCtx() *deadlineCtx {
	return &deadlineCtx{Context: context.Background(), done: make(chan struct{})}
}

func (c *deadlineCtx) expire()               { c.once.Do(func() { close(c.done) }) }
func (c *deadlineCtx) Done() <-chan struct{} { return c.done }

func (c *deadlineCtx) Err() error {
	select {
	case <-c.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}

// A deadline ends Run as a cancellation does: a graceful stop, and nil.
func TestRunReturnsNilAtItsDeadline(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	svc := brokertest.NewService(t, bus.KindNATS)
	suffix := "_" + testkit.Suffix()
	topic, handler := "orders-"+suffix, "billing-"+suffix
	brokertest.Cleanup(t, bus.KindNATS, topic, handler)
	b := svc.Open(t)
	handled := make(chan struct{}, 1)
	require.NoError(t, b.Handle(topic, handler, func(context.Context, bus.Event) error {
		select {
		case handled <- struct{}{}:
		default:
		}
		return nil
	}))

	runCtx := newDeadlineCtx()
	defer runCtx.expire()
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	require.NoError(t, b.PublishInOwnTx(ctx, topic, orderCreated("o-1")))
	select {
	case <-handled: // the relay and the handler are running
	case err := <-done:
		t.Fatalf("Run returned before its deadline: %v", err)
	case <-time.After(time.Minute):
		t.Fatal("the event never reached the handler")
	}
	runCtx.expire()
	require.ErrorIs(t, runCtx.Err(), context.DeadlineExceeded)
	require.NoError(t, <-done, "a deadline is a clean stop")
}

// Run exports each handler's backlog and the age of the events it handled,
// on every broker. A handler that holds its first event, with one worker
// and one message in flight, leaves a backlog of N events: on Kafka all N
// (nothing is committed while the first is in flight), on NATS and
// RabbitMQ the N-1 the broker has not delivered yet (the NATS consumer has
// max_ack_pending 1, and consumer.prefetch 1 is the RabbitMQ channel's). Once the handler is released
// the backlog is 0, and the age histogram has one observation per event,
// each older than the time the events were held.
func TestRunExportsTheBacklog(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, func(t *testing.T, kind string) {
		r := newBacklogRig(t, kind)
		r.publish()
		want := float64(backlogEvents - 1)
		if kind == bus.KindKafka {
			want = backlogEvents
		}
		testkit.Eventually(t, time.Minute, fmt.Sprintf("a backlog of %v", want), func() bool { return r.backlog() == want })
		_, ages := r.gather()
		require.Zero(t, ages.GetSampleCount(), "no event handled yet")
		time.Sleep(backlogHeld)
		close(r.release)
		r.checkDrainedAndAged()
	})
}

// The events of a backlog test, and how long its handler holds the first.
const (
	backlogEvents = 12
	backlogHeld   = 600 * time.Millisecond
)

// backlogRig is a service whose one handler, with one worker and one
// message in flight, holds its first event until release is closed.
type backlogRig struct {
	t            *testing.T
	reg          *prometheus.Registry
	broker       adapters.Broker
	topic, group string
	release      chan struct{}
}

// newBacklogRig runs the holding handler on kind.
func newBacklogRig(t *testing.T, kind string) *backlogRig {
	ctx := context.Background()
	s := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Relay.Enabled = new(bool)
		cfg.Metrics.BacklogInterval = 50 * time.Millisecond
		cfg.Consumer.Workers = 1
		cfg.Consumer.Prefetch = 1
		cfg.Broker.NATS.Consumer.MaxAckPending = 1
	})
	suffix := "_" + testkit.Suffix()
	r := &backlogRig{t: t, reg: prometheus.NewRegistry(), topic: "orders-" + suffix, group: "billing-" + suffix, release: make(chan struct{})}
	b := s.Open(t, bus.WithRegistry(r.reg))
	require.NoError(t, b.Handle(r.topic, r.group, func(ctx context.Context, ev bus.Event) error {
		<-r.release
		return nil
	}))
	var err error
	r.broker, err = bus.OpenBroker(ctx, s.Config, nil)
	require.NoError(t, err)
	t.Cleanup(func() { r.broker.Close() })
	require.NoError(t, r.broker.Provision(ctx, r.topic, r.group))
	brokertest.Cleanup(t, kind, r.topic, r.group)
	running := testkit.Start(t, b.Run)
	t.Cleanup(func() { _ = running.Stop(t, time.Minute) })
	return r
}

// publish puts the events on the broker, each occurring now.
func (r *backlogRig) publish() {
	ctx := context.Background()
	for i := range backlogEvents {
		id := fmt.Sprintf("e-%d", i)
		msg := delivered(ctx, id, orderCreated(fmt.Sprintf("o-%d", i)))
		msg.Metadata.Set(bus.OccurredAtKey, time.Now().UTC().Format(time.RFC3339Nano))
		require.NoError(r.t, r.broker.Publisher().Publish(r.topic, msg))
	}
}

// gather reads the backlog gauge and the age histogram.
func (r *backlogRig) gather() (backlog float64, ages *dto.Histogram) {
	families, err := r.reg.Gather()
	require.NoError(r.t, err)
	ages = &dto.Histogram{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			switch f.GetName() {
			case bus.MetricConsumerBacklog:
				backlog += m.GetGauge().GetValue()
			case bus.MetricConsumerLag:
				ages = m.GetHistogram()
			}
		}
	}
	return backlog, ages
}

// backlog is the backlog gauge.
func (r *backlogRig) backlog() float64 { n, _ := r.gather(); return n }

// checkDrainedAndAged: once released, the backlog drains and every event
// has an age observed, each older than the time the events were held.
func (r *backlogRig) checkDrainedAndAged() {
	t := r.t
	testkit.Eventually(t, time.Minute, "no backlog once every event is processed", func() bool { return r.backlog() == 0 })
	testkit.Eventually(t, time.Minute, "an age observed for every event", func() bool {
		_, ages := r.gather()
		return ages.GetSampleCount() == backlogEvents
	})
	_, ages := r.gather()
	for _, bucket := range ages.GetBucket() {
		if bucket.GetUpperBound() < backlogHeld.Seconds() {
			require.Zero(t, bucket.GetCumulativeCount(), "every event was older than %s when handled; bucket le=%v", backlogHeld, bucket.GetUpperBound())
		}
	}
	require.GreaterOrEqual(t, ages.GetSampleSum(), backlogEvents*backlogHeld.Seconds(), "the ages add up to at least the time each was held")
}

// Run consumes an ordered handler's group on NATS through the ordered
// subscriber, whose consumer has the handler's consumer.prefetch as its
// max_ack_pending (many messages in flight, at most one per aggregate), and
// leaves the other handlers' at broker.nats.consumer.max_ack_pending.
func TestRunProvisionsOrderedGroupsOnNATS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	svc := brokertest.NewService(t, bus.KindNATS, func(cfg *bus.Config) {
		cfg.Relay.Enabled = new(bool)
		cfg.Consumer.Handlers = map[string]middleware.Config{"ledger": {Ordered: new(true), Workers: 4, Prefetch: 12}}
	})
	cfg := svc.Config
	b := svc.Open(t)
	topic := "orders-_" + testkit.Suffix()
	nop := func(context.Context, bus.Event) error { return nil }
	require.NoError(t, b.Handle(topic, "ledger", nop, bus.WithConsumerGroup("ledger-"+topic)))
	require.NoError(t, b.Handle(topic, "mailer", nop, bus.WithConsumerGroup("mailer-"+topic)))
	brokertest.Cleanup(t, bus.KindNATS, topic, "ledger-"+topic, "mailer-"+topic)

	running := testkit.Start(t, b.Run)
	defer func() { require.NoError(t, running.Stop(t, time.Minute)) }()

	nc, err := natsgo.Connect(cfg.WithDefaults().Broker.NATS.URL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	maxAckPending := func(group string) int {
		c, err := js.PushConsumer(ctx, nats.StreamName(topic), nats.ConsumerName(group))
		if err != nil {
			return 0
		}
		return c.CachedInfo().Config.MaxAckPending
	}
	testkit.Eventually(t, 30*time.Second, "the ordered subscriber took its group's lease", func() bool {
		return maxAckPending("ledger-"+topic) == 12 && maxAckPending("mailer-"+topic) > 0
	})
	require.Equal(t, 32, maxAckPending("mailer-"+topic), "broker.nats.consumer.max_ack_pending's default")
}

// A new consumer group on a topic with history starts where consumer.start
// says, with the same meaning on every broker: by default (new) it gets
// the events published from the moment it is first provisioned, none from
// before, also when its first consumer joins later; with all (NATS, Kafka)
// every event the topic holds. A group that exists keeps its position
// whatever consumer.start says later. RabbitMQ refuses all at the adapter.
func TestNewGroupStartsWhereConsumerStartSays(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testStart)
}

// startRecorder records the events each handler was called with.
type startRecorder struct {
	mu  sync.Mutex
	got map[string][]string // handler -> event ids, in order
}

func (r *startRecorder) handler(name string) bus.HandlerFunc {
	return func(_ context.Context, ev bus.Event) error {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.got[name] = append(r.got[name], ev.ID)
		return nil
	}
}

func (r *startRecorder) of(name string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got[name])
}

// startRig is one topic of a real broker with the consumer groups of the
// start test: existing (the topic's other consumer), fresh (unordered, as
// handlers are by default), early (provisioned before its first consumer)
// and, where the broker keeps history, history (start: all).
type startRig struct {
	t                               *testing.T
	cfg                             bus.Config
	db                              *sql.DB
	broker                          adapters.Broker
	topic                           string
	existing, fresh, early, history string
	hasHistory                      bool
	rec                             *startRecorder
}

func newStartRig(t *testing.T, kind string) *startRig {
	ctx := context.Background()
	svc := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Relay.Enabled = new(bool)
		// Ordered, and one aggregate (so one partition on Kafka): every
		// group gets the events in publishing order, and once it got a
		// later one it would have got any earlier one it was going to.
		cfg.Consumer.Ordered = new(true)
	})
	r := &startRig{t: t, db: svc.DB, cfg: svc.Config, hasHistory: kind != bus.KindRabbitMQ, rec: &startRecorder{got: map[string][]string{}}}
	suffix := "_" + testkit.Suffix()
	r.topic = "orders-" + suffix
	r.existing, r.fresh, r.early, r.history = "existing-"+suffix, "fresh-"+suffix, "early-"+suffix, "history-"+suffix
	brokertest.Cleanup(t, kind, r.topic, r.existing, r.fresh, r.early, r.history)
	r.cfg.Consumer.Handlers = map[string]middleware.Config{r.fresh: {Ordered: new(false)}}
	if r.hasHistory {
		r.cfg.Consumer.Handlers[r.history] = middleware.Config{Start: adapters.StartAll}
	}
	var err error
	r.broker, err = bus.OpenBroker(ctx, r.cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.broker.Close() })
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("handled: %v", r.rec.got)
		}
	})
	return r
}

func (r *startRig) publish(ids ...string) {
	r.t.Helper()
	for _, id := range ids {
		require.NoError(r.t, r.broker.Publisher().Publish(r.topic, delivered(context.Background(), id, orderCreated("o-1"))))
	}
}

// run runs the handlers of fresh, early and history until until holds.
func (r *startRig) run(until func() bool) {
	r.t.Helper()
	b, err := bus.Open(context.Background(), r.cfg, r.db)
	require.NoError(r.t, err)
	defer b.Close()
	handlers := []string{r.fresh, r.early}
	if r.hasHistory {
		handlers = append(handlers, r.history)
	}
	for _, h := range handlers {
		require.NoError(r.t, b.Handle(r.topic, h, r.rec.handler(h)))
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	testkit.Eventually(r.t, 2*time.Minute, "the groups got their events", until)
	stop()
	require.NoError(r.t, <-done)
}

func testStart(t *testing.T, kind string) {
	ctx := context.Background()
	r := newStartRig(t, kind)
	// The topic's history: another group's, published before the others exist.
	require.NoError(t, r.broker.Provision(ctx, r.topic, r.existing))
	old := []string{"old-0", "old-1", "old-2"}
	r.publish(old...)
	// A group provisioned before its first consumer joins starts there.
	require.NoError(t, r.broker.ProvisionGroup(ctx, r.topic, adapters.GroupSpec{Name: r.early, Start: adapters.StartNew}))
	err := r.broker.ProvisionGroup(ctx, r.topic, adapters.GroupSpec{Name: "refused-" + r.early, Start: adapters.StartAll})
	if r.hasHistory {
		require.NoError(t, err)
	} else {
		require.True(t, adapters.IsPermanent(err), "%v", err)
		require.ErrorContains(t, err, "cannot start at the topic's history")
	}
	mid := []string{"mid-0", "mid-1"}
	r.publish(mid...)

	// Run provisions every handler's group before its consumers start: once
	// early has its events, fresh exists too.
	fresh, early, history := r.fresh, r.early, r.history
	fresh1 := []string{"new-0", "new-1", "new-2"}
	r.run(func() bool {
		if len(r.rec.of(early)) < len(mid) {
			return false
		}
		if len(r.rec.of(fresh)) == 0 && len(r.rec.of(early)) == len(mid) {
			r.publish(fresh1...)
		}
		return len(r.rec.of(fresh)) == len(fresh1) && len(r.rec.of(early)) == len(mid)+len(fresh1) &&
			(!r.hasHistory || len(r.rec.of(history)) == len(old)+len(mid)+len(fresh1))
	})
	require.ElementsMatch(t, fresh1, r.rec.of(fresh), "new: only what was published once the group existed")
	require.Equal(t, append(slices.Clone(mid), fresh1...), r.rec.of(early), "new: from when it was provisioned, not from its first consumer")
	if r.hasHistory {
		require.Equal(t, append(append(slices.Clone(old), mid...), fresh1...), r.rec.of(history), "all: the topic's history first")
	}

	// The groups exist now: starting them at all changes nothing.
	if r.hasHistory {
		r.cfg.Consumer.Handlers[fresh] = middleware.Config{Ordered: new(false), Start: adapters.StartAll}
		r.cfg.Consumer.Handlers[early] = middleware.Config{Start: adapters.StartAll}
	}
	later := []string{"later-0"}
	r.publish(later...)
	r.run(func() bool {
		return len(r.rec.of(fresh)) == len(fresh1)+len(later) && len(r.rec.of(early)) == len(mid)+len(fresh1)+len(later)
	})
	require.ElementsMatch(t, append(slices.Clone(fresh1), later...), r.rec.of(fresh), "an existing group keeps its position")
	require.Equal(t, append(append(slices.Clone(mid), fresh1...), later...), r.rec.of(early), "an existing group keeps its position")
}

// consumer.start is "new" or "all", and RabbitMQ refuses "all", naming the
// key and the reason, for the section and for each handler override.
func TestConsumerStartIsChecked(t *testing.T) {
	t.Parallel()
	check := func(kind string, consumer middleware.Config) error {
		var cfg bus.Config
		cfg.Broker.Kind = kind
		cfg.Broker.RabbitMQ.URL = "amqp://guest:guest@127.0.0.1:5672/"
		cfg.Broker.Kafka.Brokers = []string{"127.0.0.1:9092"}
		cfg.Consumer = consumer
		return cfg.WithDefaults().Validate()
	}
	require.Equal(t, adapters.StartNew, bus.Config{}.WithDefaults().Consumer.Start, "the default")
	err := check(bus.KindNATS, middleware.Config{Start: "latest"})
	require.ErrorContains(t, err, `consumer.start: must be one of new, all; got "latest"`)
	for _, kind := range []string{bus.KindNATS, bus.KindKafka} {
		require.NoError(t, check(kind, middleware.Config{Start: adapters.StartAll,
			Handlers: map[string]middleware.Config{"projection": {Start: adapters.StartNew}}}), kind)
	}
	err = check(bus.KindRabbitMQ, middleware.Config{Start: adapters.StartAll,
		Handlers: map[string]middleware.Config{"projection": {Start: adapters.StartAll}, "billing": {Workers: 2}}})
	var ce *bus.ConfigError
	require.ErrorAs(t, err, &ce)
	var paths []string
	for _, p := range ce.Problems {
		var fe *bus.FieldError
		require.ErrorAs(t, p, &fe)
		paths = append(paths, fe.Path)
		require.Contains(t, fe.Error(), "must be new with broker.kind rabbitmq: a RabbitMQ queue gets only what is published after it is bound")
	}
	require.Equal(t, []string{"consumer.handlers.projection.start", "consumer.start"}, paths, fmt.Sprint(err))
	require.NoError(t, check(bus.KindRabbitMQ, middleware.Config{}))
}
