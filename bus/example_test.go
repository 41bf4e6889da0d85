package bus_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// A business change and its event commit in one transaction. This Example
// shows the whole setup a service writes; the others share it through a
// test helper.
func ExampleBus_Publish() {
	ctx := context.Background()
	var cfg bus.Config
	cfg.Database.URL = testdb.URL()
	cfg.Database.Schema = testdb.UniqueName("example_publish")
	cfg.Broker.NATS.URL = "nats://127.0.0.1:4222"

	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	defer db.Exec(`DROP SCHEMA "` + cfg.Database.Schema + `" CASCADE`)
	if err := bus.Migrate(ctx, db, cfg); err != nil {
		log.Fatal(err)
	}
	b, err := bus.Open(ctx, cfg, db)
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()

	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	// ... the business write goes here, on tx ...
	err = b.Publish(ctx, tx, "orders.events", bus.Event{
		Type:          "OrderCreated",
		AggregateType: "order",
		AggregateID:   "ord-1",
		Payload:       []byte(`{"order_id":"ord-1","total_cents":4200}`),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}

	var rows int
	if err := db.QueryRow(`SELECT count(*) FROM "` + cfg.Database.Schema + `"."watermill_millrace_outbox"`).Scan(&rows); err != nil {
		log.Fatal(err)
	}
	fmt.Println("outbox rows:", rows)
	// Output: outbox rows: 1
}

// Config errors name the YAML path of every problem at once.
func ExampleParseConfig() {
	_, err := bus.ParseConfig([]byte(`
broker:
  kind: kafak
outbox:
  max_payload_bytes: -1
`))
	fmt.Println(err)
	// Output:
	// invalid millrace config (2 problems):
	//   outbox.max_payload_bytes: must be greater than 0; got -1
	//   broker.kind: must be one of kafka, rabbitmq, nats; got "kafak"
}

// A handler's chain without a broker: the same message delivered twice is
// handled once; the inbox acks the duplicate.
func ExampleBus_ConsumerChain() {
	ctx := context.Background()
	b, _, closeAll := brokertest.NewExampleBus("example_chain")
	defer closeAll()

	calls := 0
	handle, err := b.ConsumerChain(ctx, "orders.events", "billing", func(ctx context.Context, ev bus.Event) error {
		calls++
		fmt.Println("handling", ev.Type, ev.AggregateID, "in a transaction:", bus.Tx[*sql.Tx](ctx) != nil)
		return nil
	}, nil)
	if err != nil {
		log.Fatal(err)
	}
	// The message as a broker delivers it: the event's envelope in metadata.
	msg := message.NewMessage("evt-1", []byte(`{}`))
	msg.Metadata = message.Metadata{
		bus.EventIDKey: "evt-1", bus.EventTypeKey: "OrderPlaced",
		bus.AggregateTypeKey: "order", bus.AggregateIDKey: "ord-1",
	}
	for range 2 {
		delivery := msg.Copy()
		delivery.SetContext(ctx)
		fmt.Println("ack:", handle(delivery) == nil)
	}
	fmt.Println("handler calls:", calls)
	// Output:
	// handling OrderPlaced ord-1 in a transaction: true
	// ack: true
	// ack: true
	// handler calls: 1
}

// GrantSQL prints what the service role needs; run it as the tables' owner.
func ExampleGrantSQL() {
	var cfg bus.Config
	cfg.Database.Schema = "billing"
	sql, err := bus.GrantSQL(cfg, "billing_app")
	if err != nil {
		panic(err)
	}
	fmt.Print(sql[:strings.Index(sql, "-- relay")])
	// Output:
	// -- every part: look up millrace's tables
	// GRANT USAGE ON SCHEMA "billing" TO "billing_app";
	// -- publish: write events into the outbox
	// GRANT INSERT ON TABLE "billing"."watermill_millrace_outbox" TO "billing_app";
	// -- publish: number outbox rows (the "offset" column)
	// GRANT USAGE ON SEQUENCE "billing"."watermill_millrace_outbox_offset_seq" TO "billing_app";
}

// Router middleware wraps every handler Run runs, outside millrace's chain:
// here it logs how long each message took, inbox transaction included,
// before the message is acked.
func ExampleWithRouterMiddleware() {
	timing := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			start := time.Now()
			out, err := h(msg)
			log.Printf("event %s handled in %s, err: %v", msg.Metadata.Get(bus.EventIDKey), time.Since(start), err)
			return out, err
		}
	}
	ctx := context.Background()
	cfg, err := bus.LoadConfig("config.yaml")
	if err != nil {
		log.Fatal(err)
	}
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	b, err := bus.Open(ctx, cfg, db, bus.WithRouterMiddleware(timing))
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	// Register handlers with b.Handle, then:
	if err := b.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

// A handler whose dependency is down: the probe says so, so the event waits
// (here until its delivery ends, as at a stop) and is handed back to the
// broker, not poisoned; once the probe passes it is processed.
func ExampleWithDependencyProbe() {
	ctx := context.Background()
	b, _, closeAll := brokertest.NewExampleBus("example_probe", func(c *bus.Config) {
		c.Consumer.Breaker.OpenTimeout = 100 * time.Millisecond // how often the probe is asked while it fails
	})
	defer closeAll()

	var down atomic.Bool
	down.Store(true)
	inventory := func(context.Context) error { // a health check of the service the handler calls
		if down.Load() {
			return errors.New("inventory: connection refused")
		}
		return nil
	}
	handle, err := b.ConsumerChain(ctx, "orders.events", "billing", func(ctx context.Context, ev bus.Event) error {
		return inventory(ctx) // the handler's call to the service
	}, nil, bus.WithDependencyProbe(inventory))
	if err != nil {
		log.Fatal(err)
	}
	msg := message.NewMessage("evt-1", []byte(`{}`))
	msg.Metadata = message.Metadata{
		bus.EventIDKey: "evt-1", bus.EventTypeKey: "OrderPlaced",
		bus.AggregateTypeKey: "order", bus.AggregateIDKey: "ord-1",
	}
	stopping, stop := context.WithTimeout(ctx, time.Second)
	defer stop()
	delivery := msg.Copy()
	delivery.SetContext(stopping)
	fmt.Println("inventory down, ack:", handle(delivery) == nil)

	down.Store(false)
	delivery = msg.Copy()
	delivery.SetContext(ctx)
	fmt.Println("inventory up, ack:", handle(delivery) == nil)
	// Output:
	// inventory down, ack: false
	// inventory up, ack: true
}

// An event scheduled for later, in the caller's transaction, and cancelled
// before it is due: it is never published.
func ExampleBus_Schedule() {
	ctx := context.Background()
	b, svc, closeAll := brokertest.NewExampleBus("example_schedule")
	defer closeAll()

	tx, err := svc.DB.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	ids, err := b.Schedule(ctx, tx, "orders.events", bus.DueIn(30*time.Minute), bus.Event{
		ID:            "remind-ord-1",
		Type:          "PaymentReminderDue",
		AggregateType: "order",
		AggregateID:   "ord-1",
		Payload:       []byte(`{"order_id":"ord-1"}`),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	fmt.Println("scheduled:", ids[0])

	// The order was paid: the reminder is no longer wanted.
	tx, err = svc.DB.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := b.CancelScheduled(ctx, tx, ids[0]); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	fmt.Println("cancelled")

	_, err = b.Schedule(ctx, tx, "orders.events", bus.DueIn(-time.Minute), bus.Event{})
	fmt.Println(err)
	// Output:
	// scheduled: remind-ord-1
	// cancelled
	// millrace: invalid schedule: Delay: must not be negative; got -1m0s
}

// On pgx, the same Open, Migrate and Publish: Open takes the
// *pgxpool.Pool, and Publish the pgx.Tx through bus.Pgx. Its handlers get
// their transaction as bus.Tx[pgx.Tx](ctx).
func ExamplePgx() {
	ctx := context.Background()
	var cfg bus.Config
	cfg.Database.Schema = testdb.UniqueName("example_pgx")
	cfg.Broker.NATS.URL = "nats://127.0.0.1:4222"

	pool, err := pgxpool.New(ctx, testdb.URL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	defer pool.Exec(ctx, `DROP SCHEMA "`+cfg.Database.Schema+`" CASCADE`)
	if err := bus.Migrate(ctx, pool, cfg); err != nil {
		log.Fatal(err)
	}
	b, err := bus.Open(ctx, cfg, pool)
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()

	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	// ... the business write goes here, on tx ...
	err = b.Publish(ctx, bus.Pgx(tx), "orders.events", bus.Event{
		Type:          "OrderCreated",
		AggregateType: "order",
		AggregateID:   "ord-1",
		Payload:       []byte(`{"order_id":"ord-1","total_cents":4200}`),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		log.Fatal(err)
	}

	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM "`+cfg.Database.Schema+`".watermill_millrace_outbox`).Scan(&rows); err != nil {
		log.Fatal(err)
	}
	fmt.Println("outbox rows:", rows)
	// Output: outbox rows: 1
}

// printOutboxRows prints how many rows the outbox of svc holds.
func printOutboxRows(svc *brokertest.Service) {
	var rows int
	if err := svc.DB.QueryRow(`SELECT count(*) FROM ` + svc.Table("watermill_millrace_outbox")).Scan(&rows); err != nil {
		log.Fatal(err)
	}
	fmt.Println("outbox rows:", rows)
}
