// Package orders is an example order service: it stores each order and
// publishes its OrderCreated event in the same database transaction.
package orders

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"

	"github.com/millrace-io/millrace/bus"
)

// Topic is where OrderCreated events go.
const Topic = "orders.events"

// OrderCreated is the event's payload.
type OrderCreated struct {
	OrderID    string `json:"order_id"`
	Customer   string `json:"customer"`
	TotalCents int64  `json:"total_cents"`
}

// Service creates orders.
type Service struct {
	// Topic is where the service publishes; Topic by default.
	Topic  string
	bus    *bus.Bus
	db     *sql.DB
	schema string
}

// New returns the service; Setup must have run.
func New(b *bus.Bus, db *sql.DB, schema string) *Service {
	return &Service{Topic: Topic, bus: b, db: db, schema: schema}
}

// Setup creates the orders table.
func Setup(ctx context.Context, db *sql.DB, schema string) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS "`+schema+`".orders (
		id text PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`)
	return err
}

// Create is the business transaction: the order row and its event commit
// together, or neither does. check runs last inside the transaction; when
// it fails (a declined payment, say) everything rolls back.
func (s *Service) Create(ctx context.Context, o OrderCreated, check func() error) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit

	if _, err := tx.ExecContext(ctx, `INSERT INTO "`+s.schema+`".orders (id, customer, total_cents) VALUES ($1, $2, $3)`,
		o.OrderID, o.Customer, o.TotalCents); err != nil {
		return fmt.Errorf("insert order %s: %w", o.OrderID, err)
	}
	payload, err := json.Marshal(o)
	if err != nil {
		return err
	}
	if err := s.bus.Publish(ctx, tx, s.Topic, bus.Event{
		Type:             "OrderCreated",
		AggregateType:    "order",
		AggregateID:      o.OrderID,
		AggregateVersion: 1,
		Payload:          payload,
	}); err != nil {
		return err
	}
	if check != nil {
		if err := check(); err != nil {
			return err // the deferred Rollback drops the order and its event
		}
	}
	return tx.Commit()
}

// Count returns how many orders are stored.
func Count(ctx context.Context, db *sql.DB, schema string) (int, error) {
	var n int
	err := db.QueryRowContext(ctx, `SELECT count(*) FROM "`+schema+`".orders`).Scan(&n)
	return n, err
}
