package bus_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/protobuf/proto"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/bus/internal/testpb"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/ops"
)

// Typed events through the relay and a real broker of each kind: published
// on *sql.Tx and pgx.Tx, consumed by a Bus opened on a pgxpool.
func TestTypedEventsOnEveryBroker(t *testing.T) {
	t.Parallel()
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			testTypedEvents(t, kind)
		})
	}
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

func testTypedEvents(t *testing.T, kind string) {
	ctx := context.Background()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, kind, &cfg)
	cfg.Consumer.HandlerTimeout = 10 * time.Second
	suffix := testdb.UniqueName("")[2:]
	orders, ordersPB := "orders-"+suffix, "orderspb-"+suffix
	billing, audit, shipping := "billing-"+suffix, "audit-"+suffix, "shipping-"+suffix
	brokertest.Cleanup(t, kind, orders, billing, audit)
	brokertest.Cleanup(t, kind, ordersPB, shipping)
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	_, err := db.Exec(`CREATE TABLE "` + cfg.Database.Schema + `".shipments (order_id text PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)

	// The consumer knows OrderPlaced up to version 2 and OrderCancelled.
	placed := bus.Must(bus.NewTopic[placedV2](orders, bus.Version(2), bus.Upcast(1, upcastPlaced)))
	cancel := bus.Must(bus.NewTopic[cancelled](orders))
	pb := bus.Must(bus.NewTopic[*testpb.OrderPlaced](ordersPB, bus.WithCodec(bus.CodecProtobuf)))
	// Publishers: one still on version 1, one already on version 3, one
	// whose Go type has another name.
	oldPublisher := bus.Must(bus.NewTopic[placedV1](orders))
	newPublisher := bus.Must(bus.NewTopic[placedV3](orders, bus.Version(3)))
	renamedPublisher := bus.Must(bus.NewTopic[placedBeforeRename](orders, bus.Version(2)))

	// pgxBus runs the relay and every handler (one Run provisions every
	// handler's topology before the relay publishes); sqlBus, on the same
	// outbox, only publishes.
	reg := prometheus.NewRegistry()
	pool := newPool(t)
	pgxBus, err := bus.Open(ctx, cfg, pool, bus.WithRegistry(reg))
	require.NoError(t, err)
	defer pgxBus.Close()
	sqlBus, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	defer sqlBus.Close()

	seen := &typedSeen{placed: map[string]bus.Message[placedV2]{}, shipped: map[string]*testpb.OrderPlaced{}}
	require.NoError(t, pgxBus.HandleTypes(billing, []bus.Route{
		bus.On(placed, func(_ context.Context, m bus.Message[placedV2]) error {
			seen.mu.Lock()
			defer seen.mu.Unlock()
			seen.placed[m.Value.OrderID] = m
			return nil
		}),
		bus.On(cancel, func(_ context.Context, m bus.Message[cancelled]) error {
			seen.mu.Lock()
			defer seen.mu.Unlock()
			seen.cancelled = append(seen.cancelled, m.Value.OrderID)
			return nil
		}),
	}, bus.WithUnknownTypes(bus.PoisonUnknown)))
	require.NoError(t, cancel.Handle(pgxBus, audit, func(_ context.Context, m bus.Message[cancelled]) error {
		seen.mu.Lock()
		defer seen.mu.Unlock()
		seen.audited = append(seen.audited, m.Value.OrderID)
		return nil
	}))
	require.NoError(t, pb.Handle(pgxBus, shipping, func(ctx context.Context, m bus.Message[*testpb.OrderPlaced]) error {
		if _, err := bus.Tx[pgx.Tx](ctx).Exec(ctx, `INSERT INTO "`+cfg.Database.Schema+`".shipments VALUES ($1, $2)`, m.Value.GetOrderId(), m.ID); err != nil {
			return err
		}
		seen.mu.Lock()
		defer seen.mu.Unlock()
		seen.shipped[m.Value.GetOrderId()] = m.Value
		return nil
	}))

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- pgxBus.Run(runCtx) }()

	// database/sql publishers.
	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(ctx)
	spanCtx, span := tp.Tracer("test").Start(ctx, "place order")
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, oldPublisher.Publish(spanCtx, sqlBus, tx, placedV1{OrderID: "o-1", Total: 12.34}))
	span.End()
	require.NoError(t, renamedPublisher.Publish(ctx, sqlBus, tx, placedBeforeRename{OrderID: "o-2", TotalCents: 200}))
	require.NoError(t, newPublisher.Publish(ctx, sqlBus, tx, placedV3{OrderID: "o-3", TotalCents: 300, Currency: "EUR"}))
	require.NoError(t, cancel.Publish(ctx, sqlBus, tx, cancelled{OrderID: "o-4", Reason: "changed mind"}))
	require.NoError(t, sqlBus.Publish(ctx, tx, orders, bus.Event{Type: "OrderShipped", AggregateType: "order", AggregateID: "o-5", Payload: []byte(`{}`)}))
	require.NoError(t, tx.Commit())
	tx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, placed.Publish(ctx, sqlBus, tx, placedV2{OrderID: "o-rolled-back", TotalCents: 1}))
	require.NoError(t, tx.Rollback())
	// pgx publishers, protobuf.
	ptx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, pb.Publish(ctx, pgxBus, bus.Pgx(ptx), &testpb.OrderPlaced{OrderId: "p-1", TotalCents: 4200, Items: []string{"book", "lamp"}}))
	require.NoError(t, ptx.Commit(ctx))
	ptx, err = pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, pb.Publish(ctx, pgxBus, bus.Pgx(ptx), &testpb.OrderPlaced{OrderId: "p-rolled-back"}))
	require.NoError(t, ptx.Rollback(ctx))

	oc, err := ops.New(ctx, db, cfg)
	require.NoError(t, err)
	poisoned := func() map[string]string {
		list, err := oc.DLQ().List(ctx, ops.Filter{Handler: billing}, 0)
		require.NoError(t, err)
		out := map[string]string{}
		for _, m := range list.Rows {
			out[m.AggregateID] = m.Reason
		}
		return out
	}
	w := chainWorld{reg: reg}
	unknown := func(handler, typ string) float64 {
		return w.counter(t, bus.MetricUnknownTypes, map[string]string{"handler": handler, "event_type": typ})
	}
	// Everything is settled when billing has two placed and one cancelled,
	// audit one cancelled and four unknown, shipping one, and billing two
	// poisoned.
	settled := func() (bool, string) {
		p, c, a, s := seen.count()
		state := fmt.Sprintf("placed %d of 2, cancelled %d of 1, audited %d of 1, shipped %d of 1, poisoned %v, audit unknown %v+%v of 3+1",
			p, c, a, s, poisoned(), unknown(audit, "OrderPlaced"), unknown(audit, "OrderShipped"))
		return p == 2 && c == 1 && a == 1 && s == 1 && len(poisoned()) == 2 &&
			unknown(audit, "OrderPlaced") == 3 && unknown(audit, "OrderShipped") == 1, state
	}
	for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ok, state := settled()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not every event settled within 90s: %s", kind, state)
		}
	}

	seen.mu.Lock()
	defer seen.mu.Unlock()
	require.EqualValues(t, 1234, seen.placed["o-1"].Value.TotalCents, "version 1 upcast to the version 2 handler")
	require.Equal(t, 1, seen.placed["o-1"].SchemaVersion)
	require.Equal(t, span.SpanContext().TraceID(), seen.placed["o-1"].Trace.TraceID(), "the envelope has the publishing span")
	require.Equal(t, placedV2{OrderID: "o-2", TotalCents: 200}, seen.placed["o-2"].Value, "a renamed Go type keeps its wire name")
	require.Equal(t, []string{"o-4"}, seen.cancelled, "two types on one topic reach their own functions")
	require.Equal(t, []string{"o-4"}, seen.audited)
	require.True(t, proto.Equal(&testpb.OrderPlaced{OrderId: "p-1", TotalCents: 4200, Items: []string{"book", "lamp"}}, seen.shipped["p-1"]))
	require.NotContains(t, seen.placed, "o-rolled-back")
	require.NotContains(t, seen.shipped, "p-rolled-back")

	reasons := poisoned()
	require.True(t, containsAll(reasons["o-3"], "schema version 3", "newer than version 2"), reasons["o-3"])
	require.True(t, containsAll(reasons["o-5"], `event type "OrderShipped" has no route in handler `+billing), reasons["o-5"])
	require.EqualValues(t, 1, unknown(billing, "OrderShipped"))
	var shipments int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".shipments`).Scan(&shipments))
	require.Equal(t, 1, shipments, "the pgx handler's write committed with its inbox row")
	var outboxRows int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".watermill_millrace_outbox`).Scan(&outboxRows))
	require.Equal(t, 6, outboxRows, "rolled-back transactions wrote nothing")

	stop()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		t.Fatal("Run did not return after its context was cancelled")
	}
}
