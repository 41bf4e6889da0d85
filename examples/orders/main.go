// Command orders is an order service: it stores each order and publishes its
// OrderCreated event in the same database transaction through millrace.
//
// Run it with `make demo`. It commits a few orders, rolls one back, and shows
// what the outbox holds for this run: one event per committed order, none for
// the rolled-back one.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"

	"github.com/google/uuid"

	"github.com/millrace-io/millrace/bus"
)

func main() {
	configPath := flag.String("config", "config.yaml", "path to config.yaml")
	count := flag.Int("orders", 3, "how many orders to commit")
	flag.Parse()
	cfg, err := bus.LoadConfig(*configPath)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := run(context.Background(), cfg, *count, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

// OrderCreated is the event's payload.
type OrderCreated struct {
	OrderID    string `json:"order_id"`
	Customer   string `json:"customer"`
	TotalCents int64  `json:"total_cents"`
}

// run commits count orders and one rolled-back order, then returns how many
// events the outbox holds for this run.
func run(ctx context.Context, cfg bus.Config, count int, out io.Writer) (int, error) {
	cfg = cfg.WithDefaults()
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		return 0, err
	}
	defer db.Close()
	if err := bus.Migrate(ctx, db, cfg); err != nil {
		return 0, err
	}
	orders := fmt.Sprintf(`"%s".orders`, cfg.Database.Schema)
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+orders+
		` (id text PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return 0, err
	}
	b, err := bus.Open(ctx, cfg, db)
	if err != nil {
		return 0, err
	}
	defer b.Close()

	runID := uuid.NewString()
	fmt.Fprintf(out, "run %s: committing %d orders and rolling one back\n", runID[:8], count)
	for i := range count {
		if err := createOrder(ctx, b, db, orders, runID, int64(1000*(i+1)), false); err != nil {
			return 0, err
		}
	}
	if err := createOrder(ctx, b, db, orders, runID, 999, true); !errors.Is(err, errPaymentDeclined) {
		return 0, fmt.Errorf("expected the last order to roll back, got %v", err)
	}
	return showOutbox(ctx, db, cfg, runID, out)
}

var errPaymentDeclined = errors.New("payment declined")

// createOrder is the business transaction: the order row and its event commit
// together, or neither does.
func createOrder(ctx context.Context, b *bus.Bus, db *sql.DB, table, runID string, total int64, decline bool) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit

	order := OrderCreated{OrderID: "ord-" + uuid.NewString()[:8], Customer: "c-42", TotalCents: total}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+table+` (id, customer, total_cents) VALUES ($1, $2, $3)`,
		order.OrderID, order.Customer, order.TotalCents); err != nil {
		return err
	}
	payload, err := json.Marshal(order)
	if err != nil {
		return err
	}
	if err := b.Publish(ctx, tx, "orders.events", bus.Event{
		Type:             "OrderCreated",
		AggregateType:    "order",
		AggregateID:      order.OrderID,
		AggregateVersion: 1,
		CorrelationID:    runID,
		Payload:          payload,
	}); err != nil {
		return err
	}
	if decline {
		return errPaymentDeclined // the deferred Rollback drops the order and its event
	}
	return tx.Commit()
}

// showOutbox prints this run's rows of the outbox table with plain SQL and
// returns how many there are.
func showOutbox(ctx context.Context, db *sql.DB, cfg bus.Config, runID string, out io.Writer) (int, error) {
	rows, err := db.QueryContext(ctx, fmt.Sprintf(`
		SELECT payload->>'destination_topic', payload->'metadata'->>'event-type',
		       payload->'metadata'->>'aggregate-id', payload->>'uuid'
		FROM "%s"."watermill_%s"
		WHERE payload->'metadata'->>'correlation-id' = $1
		ORDER BY transaction_id, "offset"`, cfg.Database.Schema, cfg.Outbox.Topic), runID)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var topic, typ, aggregate, id string
		if err := rows.Scan(&topic, &typ, &aggregate, &id); err != nil {
			return 0, err
		}
		n++
		fmt.Fprintf(out, "  outbox row %d: topic=%s type=%s aggregate=%s event-id=%s\n", n, topic, typ, aggregate, id)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	fmt.Fprintf(out, "outbox holds %d events for this run: one per committed order, none for the rolled-back one\n", n)
	return n, nil
}
