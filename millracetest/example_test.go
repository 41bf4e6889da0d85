package millracetest_test

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/millracetest"
)

// exampleDB opens the test database (DATABASE_URL, or the local server),
// creates a schema for one example and in it table with columns, and
// returns the table's qualified name; drop removes the schema.
func exampleDB(table, columns string) (db *sql.DB, schema, qualified string, drop func()) {
	db, err := sql.Open("pgx", testdb.URL())
	if err != nil {
		panic(err)
	}
	schema = testdb.UniqueName("example")
	qualified = `"` + schema + `".` + table
	for _, ddl := range []string{`CREATE SCHEMA "` + schema + `"`, `CREATE TABLE ` + qualified + ` (` + columns + `)`} {
		if _, err := db.Exec(ddl); err != nil {
			panic(err)
		}
	}
	return db, schema, qualified, func() {
		db.Exec(`DROP SCHEMA "` + schema + `" CASCADE`)
		db.Close()
	}
}

// printTB stands in for the *testing.T a test passes to New: it prints what
// the harness reports, so that the examples can show it.
type printTB struct{}

func (printTB) Helper()                           {}
func (printTB) Errorf(format string, args ...any) { fmt.Printf(format+"\n", args...) }
func (printTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (printTB) Logf(string, ...any)               {}

// quiet keeps the chain's logs out of the examples' output.
var quiet = slog.New(slog.DiscardHandler)

// A billing handler that writes its invoice in bus.Tx has one invoice
// per order event, whatever the delivery does. In a test, pass t to New.
func Example() {
	db, schema, invoices, drop := exampleDB("invoices", "order_id text NOT NULL, event_id text NOT NULL")
	defer drop()
	billing := func(ctx context.Context, ev bus.Event) error {
		_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO `+invoices+` VALUES ($1, $2)`, ev.AggregateID, ev.ID)
		return err
	}
	countInvoices := func(ctx context.Context, tx *sql.Tx, ev bus.Event) (int, error) {
		var n int
		err := tx.QueryRowContext(ctx, `SELECT count(*) FROM `+invoices+` WHERE event_id = $1`, ev.ID).Scan(&n)
		return n, err
	}

	h := millracetest.New(printTB{}, millracetest.Options{
		DB: db, Schema: schema, Topic: "orders.events", Group: "billing", Handler: billing, Logger: quiet,
	})
	placed := func(id string) bus.Event {
		return bus.Event{Type: "OrderPlaced", AggregateType: "order", AggregateID: id, Payload: []byte(`{"total_cents":4200}`)}
	}
	for _, run := range []struct {
		pattern string
		deliver func(bus.Event) bus.Event
	}{
		{"DeliverTwice", h.DeliverTwice},
		{"CrashAfterEffectBeforeAck", h.CrashAfterEffectBeforeAck},
		{"CrashBeforeCommit", h.CrashBeforeCommit},
		{"FailCommitOnce", h.FailCommitOnce},
	} {
		ev := run.deliver(placed("ord-" + run.pattern))
		fmt.Printf("%-26s deliveries %v, handler runs %d, invoices %d\n",
			run.pattern+":", h.Outcomes(ev), h.HandlerRuns(ev), h.Effects(countInvoices, ev))
	}
	fmt.Println("one invoice per event:", h.AssertOnce(countInvoices))
	// Output:
	// DeliverTwice:              deliveries [ok duplicate], handler runs 1, invoices 1
	// CrashAfterEffectBeforeAck: deliveries [ok duplicate], handler runs 1, invoices 1
	// CrashBeforeCommit:         deliveries [crashed ok], handler runs 2, invoices 1
	// FailCommitOnce:            deliveries [ok], handler runs 2, invoices 1
	// one invoice per event: true
}

// A handler that writes on its own connection instead of bus.Tx: the
// run that the crash rolled back left its invoice behind, and AssertOnce
// says what happened.
func ExampleHarness_AssertOnce() {
	db, schema, invoices, drop := exampleDB("invoices", "order_id text NOT NULL, event_id text NOT NULL")
	defer drop()
	notIdempotent := func(ctx context.Context, ev bus.Event) error {
		_, err := db.ExecContext(ctx, `INSERT INTO `+invoices+` VALUES ($1, $2)`, ev.AggregateID, ev.ID) // not bus.Tx
		return err
	}

	h := millracetest.New(printTB{}, millracetest.Options{
		DB: db, Schema: schema, Topic: "orders.events", Group: "billing", Handler: notIdempotent, Logger: quiet,
	})
	h.CrashBeforeCommit(bus.Event{
		ID: "ord-1-placed", Type: "OrderPlaced", AggregateType: "order", AggregateID: "ord-1", Payload: []byte(`{}`),
	})
	h.AssertOnce(func(ctx context.Context, tx *sql.Tx, ev bus.Event) (int, error) {
		var n int
		err := tx.QueryRowContext(ctx, `SELECT count(*) FROM `+invoices+` WHERE event_id = $1`, ev.ID).Scan(&n)
		return n, err
	})
	// Output:
	// millracetest: event ord-1-placed (OrderPlaced of order ord-1): 2 effects, want exactly 1
	//     delivery 1 (CrashBeforeCommit, process 1: the process dies when the handler returns, before the commit): crashed, handler ran 1 time, not acked
	//     delivery 2 (CrashBeforeCommit, process 2: redelivered to the restarted process): ok, handler ran 1 time, acked
	//     The handler ran 2 times: 1 run committed, 1 was rolled back, undoing what it wrote in bus.Tx. Yet 2 effects remain, so the handler has effects outside bus.Tx (a write on its own connection or pool, a call to another service, a message sent directly) that no rollback undoes. Write them in bus.Tx, publish follow-ups with bus.Publish(ctx, bus.Tx[bus.Execer](ctx), ...), or make the outside effect idempotent, keyed by the event id.
}

// Two status events of one order arrive newest first. With
// consumer.ordering_guard on, the older one is dropped as stale and the
// projection keeps the newest status.
func ExampleHarness_Reorder() {
	db, schema, statuses, drop := exampleDB("order_status", "order_id text PRIMARY KEY, status text NOT NULL")
	defer drop()
	project := func(ctx context.Context, ev bus.Event) error {
		_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO `+statuses+` VALUES ($1, $2::jsonb->>'status')
			ON CONFLICT (order_id) DO UPDATE SET status = EXCLUDED.status`, ev.AggregateID, string(ev.Payload))
		return err
	}
	var cfg bus.Config
	guard := true
	cfg.Consumer.OrderingGuard = &guard

	h := millracetest.New(printTB{}, millracetest.Options{
		DB: db, Schema: schema, Config: cfg, Topic: "orders.events", Group: "order-status", Handler: project, Logger: quiet,
	})
	status := func(version int64, s string) bus.Event {
		return bus.Event{Type: "OrderStatusChanged", AggregateType: "order", AggregateID: "ord-1",
			AggregateVersion: version, Payload: []byte(`{"status":"` + s + `"}`)}
	}
	evs := h.Reorder(status(1, "placed"), status(2, "paid"))
	for _, ev := range evs {
		fmt.Printf("version %d: %v\n", ev.AggregateVersion, h.Outcomes(ev))
	}
	var s string
	if err := db.QueryRow(`SELECT status FROM ` + statuses + ` WHERE order_id = 'ord-1'`).Scan(&s); err != nil {
		panic(err)
	}
	fmt.Println("status:", s)
	// Output:
	// version 1: [stale]
	// version 2: [ok]
	// status: paid
}
