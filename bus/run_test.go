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
)

// The same service code runs on each broker; only broker.kind changes.
func TestServiceRunsOnEveryBroker(t *testing.T) {
	t.Parallel()
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			testServiceRoundTrip(t, kind)
		})
	}
}

type audited struct {
	ev      bus.Event
	traceID trace.TraceID
}

func testServiceRoundTrip(t *testing.T, kind string) {
	ctx := context.Background()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, kind, &cfg)
	cfg.Consumer.HandlerTimeout = 10 * time.Second
	suffix := testdb.UniqueName("")[2:]
	orders, invoices := "orders-"+suffix, "invoices-"+suffix
	billing, audit := "billing-"+suffix, "audit-"+suffix
	brokertest.Cleanup(t, kind, orders, billing)
	brokertest.Cleanup(t, kind, invoices, audit)
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	_, err := db.Exec(`CREATE TABLE "` + cfg.Database.Schema + `".invoices (order_id text PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)

	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(ctx)
	b, err := bus.Open(ctx, cfg, db, bus.WithTracerProvider(tp))
	require.NoError(t, err)
	defer b.Close()

	// billing writes an invoice and publishes InvoiceIssued in the inbox
	// transaction; audit records what arrives.
	require.NoError(t, b.Handle(orders, billing, func(ctx context.Context, ev bus.Event) error {
		tx := bus.Tx[*sql.Tx](ctx)
		if _, err := tx.ExecContext(ctx, `INSERT INTO "`+cfg.Database.Schema+`".invoices VALUES ($1, $2)`, ev.AggregateID, ev.ID); err != nil {
			return err
		}
		return b.Publish(ctx, tx, invoices, bus.Event{Type: "InvoiceIssued", AggregateType: "invoice", AggregateID: ev.AggregateID, Payload: []byte(`{}`)})
	}))
	var mu sync.Mutex
	var seen []audited
	require.NoError(t, b.Handle(invoices, audit, func(ctx context.Context, ev bus.Event) error {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, audited{ev: ev, traceID: trace.SpanContextFromContext(ctx).TraceID()})
		return nil
	}))
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()

	const n = 30
	published := map[string]trace.TraceID{} // order aggregate id -> trace of its publishing span
	tracer := tp.Tracer("test")
	for i := range n {
		spanCtx, span := tracer.Start(ctx, "create order")
		id := fmt.Sprintf("ord-%d", i)
		tx, err := db.BeginTx(spanCtx, nil)
		require.NoError(t, err)
		require.NoError(t, b.Publish(spanCtx, tx, orders, bus.Event{Type: "OrderCreated", AggregateType: "order", AggregateID: id, Payload: []byte(`{"id":"` + id + `"}`)}))
		require.NoError(t, tx.Commit())
		span.End()
		published[id] = span.SpanContext().TraceID()
	}

	deadline := time.Now().Add(90 * time.Second)
	for {
		mu.Lock()
		got := len(seen)
		mu.Unlock()
		if got >= n {
			break
		}
		require.True(t, time.Now().Before(deadline), "%s: %d of %d follow-up events arrived", kind, got, n)
		time.Sleep(20 * time.Millisecond)
	}

	var invoicesCount, inboxRows int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".invoices`).Scan(&invoicesCount))
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".millrace_inbox WHERE consumer_group = $1`, billing).Scan(&inboxRows))
	require.Equal(t, n, invoicesCount)
	require.Equal(t, n, inboxRows)

	mu.Lock()
	defer mu.Unlock()
	byOrder := map[string]audited{}
	for _, a := range seen {
		byOrder[a.ev.AggregateID] = a
	}
	require.Len(t, byOrder, n)
	for id, traceID := range published {
		a := byOrder[id]
		var orderEventID string
		require.NoError(t, db.QueryRow(`SELECT event_id FROM "`+cfg.Database.Schema+`".invoices WHERE order_id = $1`, id).Scan(&orderEventID))
		require.Equal(t, orderEventID, a.ev.CausationID, "the follow-up's causation is the order event")
		require.Equal(t, orderEventID, a.ev.CorrelationID, "the flow is correlated by its first event")
		require.Equal(t, traceID, a.traceID, "one trace from the order's publish to the audit handler")
	}

	stop()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		t.Fatal("Run did not return after its context was cancelled")
	}
}
