package bus_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// The same service code runs on each broker; only broker.kind changes.
func TestServiceRunsOnEveryBroker(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testServiceRoundTrip)
}

type audited struct {
	ev      bus.Event
	traceID trace.TraceID
}

// roundTrip is one broker's service: billing writes an invoice and
// publishes InvoiceIssued in the inbox transaction; audit records what
// arrives.
type roundTrip struct {
	t                *testing.T
	kind             string
	db               *sql.DB
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
	suffix := testdb.UniqueName("")[2:]
	r := &roundTrip{t: t, kind: kind, db: s.DB, schema: s.Config.Database.Schema, published: map[string]trace.TraceID{},
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
