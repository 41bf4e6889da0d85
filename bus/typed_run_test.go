package bus_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/bus/internal/testpb"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/ops"
)

// Typed events through the relay and a real broker of each kind: published
// on *sql.Tx and pgx.Tx, consumed by a Bus opened on a pgxpool.
func TestTypedEventsOnEveryBroker(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testTypedEvents)
}

// typedSeen records what the handlers of testTypedEvents received.
type typedSeen struct {
	mu        sync.Mutex
	placed    map[string]bus.Message[placedV2]
	cancelled []string
	audited   []string
	shipped   map[string]*testpb.OrderPlaced
}

func (s *typedSeen) count() (placed, cancelled, audited, shipped int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.placed), len(s.cancelled), len(s.audited), len(s.shipped)
}

// typedRig is one broker's service with typed topics: pgxBus (on a
// pgxpool) runs the relay and every handler, sqlBus only publishes.
type typedRig struct {
	kindRig
	pool                     *pgxpool.Pool
	cfg                      bus.Config
	reg                      *prometheus.Registry
	pgxBus, sqlBus           *bus.Bus
	orders                   string
	billing, audit, shipping string
	placed                   *bus.Topic[placedV2]
	cancel                   *bus.Topic[cancelled]
	pb                       *bus.Topic[*testpb.OrderPlaced]
	seen                     *typedSeen
	ops                      *ops.Client
	span                     trace.Span // the span o-1 was published in
}

func testTypedEvents(t *testing.T, kind string) {
	r := newTypedRig(t, kind)
	r.handle()
	running := testkit.Start(t, r.pgxBus.Run)
	r.publishOnSQL()
	r.publishOnPgx()
	r.waitSettled()
	r.checkReceived()
	r.checkPoisonedAndWritten()
	require.NoError(t, running.Stop(t, 60*time.Second))
}

// newTypedRig opens both buses on a fresh schema with a shipments table.
func newTypedRig(t *testing.T, kind string) *typedRig {
	ctx := context.Background()
	s := brokertest.NewService(t, kind, func(c *bus.Config) { c.Consumer.HandlerTimeout = 10 * time.Second })
	r := &typedRig{kindRig: kindRig{t, kind, s.DB}, cfg: s.Config, reg: prometheus.NewRegistry()}
	suffix := "_" + testkit.Suffix()
	r.orders = "orders-" + suffix
	ordersPB := "orderspb-" + suffix
	r.billing, r.audit, r.shipping = "billing-"+suffix, "audit-"+suffix, "shipping-"+suffix
	brokertest.Cleanup(t, kind, r.orders, r.billing, r.audit)
	brokertest.Cleanup(t, kind, ordersPB, r.shipping)
	_, err := r.db.Exec(`CREATE TABLE "` + r.cfg.Database.Schema + `".shipments (order_id text PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)

	// The consumer knows OrderPlaced up to version 2 and OrderCancelled.
	r.placed = bus.Must(bus.NewTopic[placedV2](r.orders, bus.Version(2), bus.Upcast(1, upcastPlaced)))
	r.cancel = bus.Must(bus.NewTopic[cancelled](r.orders))
	r.pb = bus.Must(bus.NewTopic[*testpb.OrderPlaced](ordersPB, bus.WithCodec(bus.CodecProtobuf)))

	// pgxBus runs the relay and every handler (one Run provisions every
	// handler's topology before the relay publishes); sqlBus, on the same
	// outbox, only publishes.
	r.pool = testdb.Pool(t)
	r.pgxBus, err = bus.Open(ctx, r.cfg, r.pool, bus.WithRegistry(r.reg))
	require.NoError(t, err)
	t.Cleanup(func() { r.pgxBus.Close() })
	r.sqlBus = s.Open(t)
	r.ops, err = ops.New(ctx, r.db, r.cfg)
	require.NoError(t, err)
	r.seen = &typedSeen{placed: map[string]bus.Message[placedV2]{}, shipped: map[string]*testpb.OrderPlaced{}}
	return r
}

// handle registers billing (placed and cancelled, unknown types
// poisoned), audit (cancelled) and shipping (protobuf, writing through
// the pgx transaction).
func (r *typedRig) handle() {
	t, seen := r.t, r.seen
	require.NoError(t, r.pgxBus.HandleTypes(r.billing, []bus.Route{
		bus.On(r.placed, func(_ context.Context, m bus.Message[placedV2]) error {
			seen.mu.Lock()
			defer seen.mu.Unlock()
			seen.placed[m.Value.OrderID] = m
			return nil
		}),
		bus.On(r.cancel, func(_ context.Context, m bus.Message[cancelled]) error {
			seen.mu.Lock()
			defer seen.mu.Unlock()
			seen.cancelled = append(seen.cancelled, m.Value.OrderID)
			return nil
		}),
	}, bus.WithUnknownTypes(bus.PoisonUnknown)))
	require.NoError(t, r.cancel.Handle(r.pgxBus, r.audit, func(_ context.Context, m bus.Message[cancelled]) error {
		seen.mu.Lock()
		defer seen.mu.Unlock()
		seen.audited = append(seen.audited, m.Value.OrderID)
		return nil
	}))
	require.NoError(t, r.pb.Handle(r.pgxBus, r.shipping, func(ctx context.Context, m bus.Message[*testpb.OrderPlaced]) error {
		if _, err := bus.Tx[pgx.Tx](ctx).Exec(ctx, `INSERT INTO "`+r.cfg.Database.Schema+`".shipments VALUES ($1, $2)`, m.Value.GetOrderId(), m.ID); err != nil {
			return err
		}
		seen.mu.Lock()
		defer seen.mu.Unlock()
		seen.shipped[m.Value.GetOrderId()] = m.Value
		return nil
	}))
}

// publishOnSQL publishes through database/sql: one publisher still on
// version 1 (in a span), one already on version 3, one whose Go type has
// another name, a cancel, an untyped event, and a rolled-back one.
func (r *typedRig) publishOnSQL() {
	t, ctx := r.t, context.Background()
	oldPublisher := bus.Must(bus.NewTopic[placedV1](r.orders))
	newPublisher := bus.Must(bus.NewTopic[placedV3](r.orders, bus.Version(3)))
	renamedPublisher := bus.Must(bus.NewTopic[placedBeforeRename](r.orders, bus.Version(2)))
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(ctx) })
	spanCtx, span := tp.Tracer("test").Start(ctx, "place order")
	r.span = span
	tx, err := r.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, oldPublisher.Publish(spanCtx, r.sqlBus, tx, placedV1{OrderID: "o-1", Total: 12.34}))
	span.End()
	require.NoError(t, renamedPublisher.Publish(ctx, r.sqlBus, tx, placedBeforeRename{OrderID: "o-2", TotalCents: 200}))
	require.NoError(t, newPublisher.Publish(ctx, r.sqlBus, tx, placedV3{OrderID: "o-3", TotalCents: 300, Currency: "EUR"}))
	require.NoError(t, r.cancel.Publish(ctx, r.sqlBus, tx, cancelled{OrderID: "o-4", Reason: "changed mind"}))
	require.NoError(t, r.sqlBus.Publish(ctx, tx, r.orders, bus.Event{Type: "OrderShipped", AggregateType: "order", AggregateID: "o-5", Payload: []byte(`{}`)}))
	require.NoError(t, tx.Commit())
	tx, err = r.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, r.placed.Publish(ctx, r.sqlBus, tx, placedV2{OrderID: "o-rolled-back", TotalCents: 1}))
	require.NoError(t, tx.Rollback())
}

// publishOnPgx publishes protobuf events through pgx, one rolled back.
func (r *typedRig) publishOnPgx() {
	t, ctx := r.t, context.Background()
	ptx, err := r.pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, r.pb.Publish(ctx, r.pgxBus, bus.Pgx(ptx), &testpb.OrderPlaced{OrderId: "p-1", TotalCents: 4200, Items: []string{"book", "lamp"}}))
	require.NoError(t, ptx.Commit(ctx))
	ptx, err = r.pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, r.pb.Publish(ctx, r.pgxBus, bus.Pgx(ptx), &testpb.OrderPlaced{OrderId: "p-rolled-back"}))
	require.NoError(t, ptx.Rollback(ctx))
}

// poisoned is billing's poisoned events: their reason by aggregate id.
func (r *typedRig) poisoned() map[string]string {
	return poisonReasons(r.t, r.ops, r.billing)
}

// unknown is the count of events of typ that handler had no route for.
func (r *typedRig) unknown(handler, typ string) float64 {
	return testkit.Metric(r.t, r.reg, bus.MetricUnknownTypes, map[string]string{"handler": handler, "event_type": typ})
}

// waitSettled waits until billing has two placed and one cancelled,
// audit one cancelled and four unknown, shipping one (its handler
// returned and its transaction committed: the handler records the
// shipment before the commit), and billing two poisoned.
func (r *typedRig) waitSettled() {
	settled := func() (bool, string) {
		p, c, a, s := r.seen.count()
		committed := r.shipments()
		state := fmt.Sprintf("placed %d of 2, cancelled %d of 1, audited %d of 1, shipped %d of 1 (%d committed), poisoned %v, audit unknown %v+%v of 3+1",
			p, c, a, s, committed, r.poisoned(), r.unknown(r.audit, "OrderPlaced"), r.unknown(r.audit, "OrderShipped"))
		return p == 2 && c == 1 && a == 1 && s == 1 && committed >= 1 && len(r.poisoned()) == 2 &&
			r.unknown(r.audit, "OrderPlaced") == 3 && r.unknown(r.audit, "OrderShipped") == 1, state
	}
	for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ok, state := settled()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("%s: not every event settled within 90s: %s", r.kind, state)
		}
	}
}

// checkReceived checks what each handler received.
func (r *typedRig) checkReceived() {
	t, seen := r.t, r.seen
	seen.mu.Lock()
	defer seen.mu.Unlock()
	require.EqualValues(t, 1234, seen.placed["o-1"].Value.TotalCents, "version 1 upcast to the version 2 handler")
	require.Equal(t, 1, seen.placed["o-1"].SchemaVersion)
	require.Equal(t, r.span.SpanContext().TraceID(), seen.placed["o-1"].Trace.TraceID(), "the envelope has the publishing span")
	require.Equal(t, placedV2{OrderID: "o-2", TotalCents: 200}, seen.placed["o-2"].Value, "a renamed Go type keeps its wire name")
	require.Equal(t, []string{"o-4"}, seen.cancelled, "two types on one topic reach their own functions")
	require.Equal(t, []string{"o-4"}, seen.audited)
	require.True(t, proto.Equal(&testpb.OrderPlaced{OrderId: "p-1", TotalCents: 4200, Items: []string{"book", "lamp"}}, seen.shipped["p-1"]))
	require.NotContains(t, seen.placed, "o-rolled-back")
	require.NotContains(t, seen.shipped, "p-rolled-back")
}

// checkPoisonedAndWritten checks why billing poisoned what it did, and
// what the database holds.
func (r *typedRig) checkPoisonedAndWritten() {
	t := r.t
	reasons := r.poisoned()
	require.True(t, containsAll(reasons["o-3"], "schema version 3", "newer than version 2"), reasons["o-3"])
	require.True(t, containsAll(reasons["o-5"], `event type "OrderShipped" has no route in handler `+r.billing), reasons["o-5"])
	require.EqualValues(t, 1, r.unknown(r.billing, "OrderShipped"))
	require.Equal(t, 1, r.shipments(), "the pgx handler's write committed with its inbox row")
	var outboxRows int
	require.NoError(t, r.db.QueryRow(`SELECT count(*) FROM "`+r.cfg.Database.Schema+`".watermill_millrace_outbox`).Scan(&outboxRows))
	require.Equal(t, 6, outboxRows, "rolled-back transactions wrote nothing")
}

// shipments is how many shipment rows the shipping handler committed.
func (r *typedRig) shipments() int {
	var n int
	require.NoError(r.t, r.db.QueryRow(`SELECT count(*) FROM "`+r.cfg.Database.Schema+`".shipments`).Scan(&n))
	return n
}

// A typed batch handler through the relay and a real broker of each kind:
// it writes its batch with one statement; an event it fails alone and an
// event that does not decode are poisoned, the others committed once.
func TestTypedBatchHandlerOnEveryBroker(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testTypedBatchHandler)
}

// batchRig is one broker's service with a typed batch handler that
// writes its batch of invoices with one statement.
type batchRig struct {
	kindRig
	cfg             bus.Config
	b               *bus.Bus
	orders, billing string
	invoices        string // the qualified table
	placed          *bus.Topic[placedV2]
	mu              sync.Mutex
	batches         [][]string // the order ids of each batch the handler got
}

// batchGood is how many events of a batch run are committed.
const batchGood = 10

func testTypedBatchHandler(t *testing.T, kind string) {
	r := newBatchRig(t, kind)
	r.handle()
	running := testkit.Start(t, r.b.Run)
	t.Cleanup(func() { require.NoError(t, running.Stop(t, time.Minute)) })
	r.publish()
	r.waitSettled()
	r.checkBatches()
}

// newBatchRig opens a service on kind that reads batches of up to 8.
func newBatchRig(t *testing.T, kind string) *batchRig {
	ctx := context.Background()
	r := &batchRig{kindRig: kindRig{t, kind, testdb.Open(t)}}
	r.cfg.Database.Schema = testdb.UniqueName("batch")
	_, err := r.db.Exec(`CREATE SCHEMA "` + r.cfg.Database.Schema + `"`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = r.db.Exec(`DROP SCHEMA "` + r.cfg.Database.Schema + `" CASCADE`) })
	brokertest.Apply(t, kind, &r.cfg)
	r.cfg.Consumer.Workers = 8
	r.cfg.Consumer.Batch.MaxMessages = 8
	r.cfg.Consumer.Batch.MaxWait = 200 * time.Millisecond
	suffix := "_" + testkit.Suffix()
	r.orders, r.billing = "orders-"+suffix, "billing-"+suffix
	brokertest.Cleanup(t, kind, r.orders, r.billing)
	require.NoError(t, bus.Migrate(ctx, r.db, r.cfg))
	r.invoices = `"` + r.cfg.Database.Schema + `".invoices`
	_, err = r.db.Exec(`CREATE TABLE ` + r.invoices + ` (order_id text NOT NULL, event_id text NOT NULL, total_cents bigint NOT NULL)`)
	require.NoError(t, err)
	r.b, err = bus.Open(ctx, r.cfg, r.db)
	require.NoError(t, err)
	t.Cleanup(func() { r.b.Close() })
	r.placed = bus.Must(bus.NewTopic[placedV2](r.orders, bus.Version(2)))
	return r
}

// handle registers the batch handler: it fails an event with a negative
// total alone and writes the others with one statement.
func (r *batchRig) handle() {
	require.NoError(r.t, r.placed.HandleBatch(r.b, r.billing, func(ctx context.Context, ms []bus.Message[placedV2]) error {
		var ids, events []string
		var totals []int64
		failures := bus.BatchFailures{}
		for _, m := range ms {
			if m.Value.TotalCents < 0 {
				failures[m.ID] = bus.Permanent(errors.New("negative total"))
				continue
			}
			ids, events, totals = append(ids, m.Value.OrderID), append(events, m.ID), append(totals, m.Value.TotalCents)
		}
		r.mu.Lock()
		r.batches = append(r.batches, ids)
		r.mu.Unlock()
		// One statement for the whole batch.
		if _, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO `+r.invoices+` SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])`,
			ids, events, totals); err != nil {
			return err
		}
		if len(failures) > 0 {
			return failures
		}
		return nil
	}))
}

// publish commits the good events, one the handler fails and one that
// does not decode, in one transaction.
func (r *batchRig) publish() {
	t, ctx := r.t, context.Background()
	tx, err := r.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // committed below unless the test failed
	for i := range batchGood {
		require.NoError(t, r.placed.Publish(ctx, r.b, tx, placedV2{OrderID: fmt.Sprintf("o-%d", i), TotalCents: int64(100 + i)}))
	}
	require.NoError(t, r.placed.Publish(ctx, r.b, tx, placedV2{OrderID: "o-negative", TotalCents: -1}))
	require.NoError(t, r.b.Publish(ctx, tx, r.orders, bus.Event{Type: "OrderPlaced", SchemaVersion: 2, AggregateType: "order", AggregateID: "o-garbled",
		ContentType: "application/json", Payload: []byte(`{"order_id":5}`)}))
	require.NoError(t, tx.Commit())
}

// count runs a count query.
func (r *batchRig) count(query string) int {
	var n int
	require.NoError(r.t, r.db.QueryRow(query).Scan(&n))
	return n
}

// waitSettled waits for the good events' invoices and the two poisoned
// events, and checks both.
func (r *batchRig) waitSettled() {
	t := r.t
	oc, err := ops.New(context.Background(), r.db, r.cfg)
	require.NoError(t, err)
	testkit.Eventually(t, 90*time.Second, "every event settled", func() bool {
		return r.count(`SELECT count(*) FROM `+r.invoices) == batchGood && len(poisonReasons(t, oc, r.billing)) == 2
	})
	require.Equal(t, batchGood, r.count(`SELECT count(DISTINCT event_id) FROM `+r.invoices), "one effect per event")
	reasons := poisonReasons(t, oc, r.billing)
	require.Contains(t, reasons["o-negative"], "negative total")
	require.Contains(t, reasons["o-garbled"], "does not decode")
}

// checkBatches checks what the batches held.
func (r *batchRig) checkBatches() {
	t := r.t
	r.mu.Lock()
	defer r.mu.Unlock()
	t.Logf("batches: %v", r.batches)
	for _, ids := range r.batches {
		require.NotContains(t, ids, "o-garbled", "an event that does not decode never reaches the handler")
	}
	// On NATS a backlog that is waiting when the subscriptions open can go
	// to one push subscription, which hands out one message at a time and
	// the next only after the ack, that is after the COMMIT: batches of one
	// are what the handler gets then (seen in a full run). Kafka and
	// RabbitMQ hand a subscription several unacked messages.
	if r.kind != bus.KindNATS {
		require.True(t, slices.ContainsFunc(r.batches, func(ids []string) bool { return len(ids) > 1 }), "some batch held several events: %v", r.batches)
	}
}

// poisonReasons is handler's poisoned events: their reason by aggregate id.
func poisonReasons(t *testing.T, oc *ops.Client, handler string) map[string]string {
	t.Helper()
	list, err := oc.DLQ().List(context.Background(), ops.Filter{Handler: handler}, 0)
	require.NoError(t, err)
	out := map[string]string{}
	for _, m := range list.Rows {
		out[m.AggregateID] = m.Reason
	}
	return out
}

// A batch handler is checked when it is registered, like any handler.
func TestHandleBatchRefusesBadInput(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	placed := bus.Must(bus.NewTopic[placedV2]("orders.events", bus.Version(2)))
	ok := func(context.Context, []bus.Event) error { return nil }
	require.ErrorContains(t, tb.bus.HandleBatch("orders.events", "billing", nil), `HandleBatch("orders.events", "billing"): handler func is nil`)
	require.ErrorContains(t, placed.HandleBatch(tb.bus, "billing", nil), "handler func is nil")
	require.ErrorContains(t, (*bus.Topic[placedV2])(nil).HandleBatch(tb.bus, "billing",
		func(context.Context, []bus.Message[placedV2]) error { return nil }), "the Topic is nil")
	require.ErrorContains(t, tb.bus.HandleBatch("", "billing", ok), "topic")
	require.NoError(t, tb.bus.HandleBatch("orders.events", "billing", ok))
	require.ErrorContains(t, tb.bus.Handle("orders.events", "billing", func(context.Context, bus.Event) error { return nil }),
		`handler "billing" is already registered`)
}
