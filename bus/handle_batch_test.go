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

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/ops"
)

// A typed batch handler through the relay and a real broker of each kind:
// it writes its batch with one statement; an event it fails alone and an
// event that does not decode are poisoned, the others committed once.
func TestTypedBatchHandlerOnEveryBroker(t *testing.T) {
	t.Parallel()
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			testTypedBatchHandler(t, kind)
		})
	}
}

func testTypedBatchHandler(t *testing.T, kind string) {
	ctx := context.Background()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.UniqueName("batch")
	_, err := db.Exec(`CREATE SCHEMA "` + cfg.Database.Schema + `"`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.Exec(`DROP SCHEMA "` + cfg.Database.Schema + `" CASCADE`) })
	brokertest.Apply(t, kind, &cfg)
	cfg.Consumer.Workers = 8
	cfg.Consumer.Batch.MaxMessages = 8
	cfg.Consumer.Batch.MaxWait = 200 * time.Millisecond
	suffix := testdb.UniqueName("")[2:]
	orders, billing := "orders-"+suffix, "billing-"+suffix
	brokertest.Cleanup(t, kind, orders, billing)
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	invoices := `"` + cfg.Database.Schema + `".invoices`
	_, err = db.Exec(`CREATE TABLE ` + invoices + ` (order_id text NOT NULL, event_id text NOT NULL, total_cents bigint NOT NULL)`)
	require.NoError(t, err)

	b, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	defer b.Close()
	placed := bus.Must(bus.NewTopic[placedV2](orders, bus.Version(2)))
	var mu sync.Mutex
	var batches [][]string
	require.NoError(t, placed.HandleBatch(b, billing, func(ctx context.Context, ms []bus.Message[placedV2]) error {
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
		mu.Lock()
		batches = append(batches, ids)
		mu.Unlock()
		// One statement for the whole batch.
		if _, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO `+invoices+` SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])`,
			ids, events, totals); err != nil {
			return err
		}
		if len(failures) > 0 {
			return failures
		}
		return nil
	}))
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	defer func() {
		stop()
		require.NoError(t, <-done)
	}()

	const good = 10
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // committed below unless the test failed
	for i := range good {
		require.NoError(t, placed.Publish(ctx, b, tx, placedV2{OrderID: fmt.Sprintf("o-%d", i), TotalCents: int64(100 + i)}))
	}
	require.NoError(t, placed.Publish(ctx, b, tx, placedV2{OrderID: "o-negative", TotalCents: -1}))
	require.NoError(t, b.Publish(ctx, tx, orders, bus.Event{Type: "OrderPlaced", SchemaVersion: 2, AggregateType: "order", AggregateID: "o-garbled",
		ContentType: "application/json", Payload: []byte(`{"order_id":5}`)}))
	require.NoError(t, tx.Commit())

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
	count := func(query string) int {
		var n int
		require.NoError(t, db.QueryRow(query).Scan(&n))
		return n
	}
	testkit.Eventually(t, 90*time.Second, "every event settled", func() bool {
		return count(`SELECT count(*) FROM `+invoices) == good && len(poisoned()) == 2
	})
	require.Equal(t, good, count(`SELECT count(DISTINCT event_id) FROM `+invoices), "one effect per event")
	reasons := poisoned()
	require.Contains(t, reasons["o-negative"], "negative total")
	require.Contains(t, reasons["o-garbled"], "does not decode")
	mu.Lock()
	defer mu.Unlock()
	t.Logf("batches: %v", batches)
	for _, ids := range batches {
		require.NotContains(t, ids, "o-garbled", "an event that does not decode never reaches the handler")
	}
	// On NATS a backlog that is waiting when the subscriptions open can go
	// to one push subscription, which hands out one message at a time and
	// the next only after the ack, that is after the COMMIT: batches of one
	// are what the handler gets then (seen in a full run). Kafka and
	// RabbitMQ hand a subscription several unacked messages.
	if kind != bus.KindNATS {
		require.True(t, slices.ContainsFunc(batches, func(ids []string) bool { return len(ids) > 1 }), "some batch held several events: %v", batches)
	}
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
