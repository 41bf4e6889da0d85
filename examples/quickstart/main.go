// Command quickstart is millrace's quick start, the service the README
// shows: it places orders and bills them. Each order and its typed
// OrderPlaced event commit in one transaction; the billing handler writes
// the invoice in its inbox transaction, so every event is billed once
// however often it is delivered. It places three orders, waits for their
// invoices and stops; run it as often as you like.
//
//	go run ./examples/quickstart   # from the repository root, after `make up`
package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace-io/millrace/bus"
)

// OrderPlaced is the event. EventType is its wire name (event-type), which
// stays the same whatever the Go type is called; Aggregate names the order
// it is about (the partition and ordering key).
type OrderPlaced struct {
	OrderID    string `json:"order_id"`
	TotalCents int64  `json:"total_cents"`
}

func (OrderPlaced) EventType() string             { return "OrderPlaced" }
func (e OrderPlaced) Aggregate() (string, string) { return "order", e.OrderID }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg, err := bus.LoadConfig("examples/quickstart/config.yaml")
	if err != nil {
		log.Fatal(err)
	}
	if err := run(ctx, cfg, "quickstart.orders", os.Stdout); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, cfg bus.Config, topic string, out io.Writer) error {
	pool, err := pgxpool.New(ctx, cfg.Database.URL)
	if err != nil {
		return err
	}
	defer pool.Close()
	// millrace's tables (or `millrace migrate`), then the service's own.
	if err := bus.Migrate(ctx, pool, cfg); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total_cents bigint NOT NULL);
		CREATE TABLE IF NOT EXISTS invoices (order_id text PRIMARY KEY, event_id text NOT NULL)`); err != nil {
		return err
	}
	b, err := bus.Open(ctx, cfg, pool)
	if err != nil {
		return err
	}
	defer b.Close()
	orderPlaced, err := bus.NewTopic[OrderPlaced](topic)
	if err != nil {
		return err
	}

	// Consume: the invoice is written in bus.Tx[pgx.Tx](ctx), the transaction of
	// the inbox row that makes a redelivered event a no-op.
	err = orderPlaced.Handle(b, "billing", func(ctx context.Context, m bus.Message[OrderPlaced]) error {
		_, err := bus.Tx[pgx.Tx](ctx).Exec(ctx, `INSERT INTO invoices (order_id, event_id) VALUES ($1, $2)`, m.Value.OrderID, m.ID)
		return err
	})
	if err != nil {
		return err
	}
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	ran := make(chan error, 1)
	go func() { ran <- b.Run(runCtx) }() // the relay and the handler, until runCtx ends

	// Publish: the order and its event commit together, or neither does.
	var placed []string
	for i := 1; i <= 3; i++ {
		order := OrderPlaced{OrderID: "ord-" + uuid.NewString()[:8], TotalCents: int64(i) * 1000}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, total_cents) VALUES ($1, $2)`, order.OrderID, order.TotalCents); err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		if err := orderPlaced.Publish(ctx, b, bus.Pgx(tx), order); err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		fmt.Fprintln(out, "placed", order.OrderID)
		placed = append(placed, order.OrderID)
	}

	if err := waitForInvoices(ctx, pool, placed, ran); err != nil {
		return err
	}
	fmt.Fprintln(out, "billed", len(placed), "orders, each once")
	stopRun()
	return <-ran
}

// waitForInvoices polls until the orders have their invoices, Run fails,
// or ctx ends.
func waitForInvoices(ctx context.Context, pool *pgxpool.Pool, orders []string, ran <-chan error) error {
	for {
		var count int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM invoices WHERE order_id = ANY($1)`, orders).Scan(&count); err != nil {
			return err
		}
		if count == len(orders) {
			return nil
		}
		select {
		case err := <-ran:
			return fmt.Errorf("run stopped before the orders were billed: %w", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
