// Package billing is an example consumer: it bills every OrderCreated event
// once, writing its projection in the inbox transaction millrace opens for
// the handler, so a redelivered event is skipped and never billed twice.
package billing

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/examples/orders"
)

// HandlerName is the handler's name and consumer group.
const HandlerName = "billing"

// Setup creates the billing projection.
func Setup(ctx context.Context, db *sql.DB, schema string) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS "`+schema+`".billing (
		order_id text PRIMARY KEY, amount_cents bigint NOT NULL, event_id text NOT NULL,
		billed_at timestamptz NOT NULL DEFAULT now())`)
	return err
}

// Handler bills one order. A payload that does not decode can never
// succeed, so it is Permanent: poisoned at once, not retried.
func Handler(schema string) bus.HandlerFunc {
	return func(ctx context.Context, ev bus.Event) error {
		var o orders.OrderCreated
		if err := json.Unmarshal(ev.Payload, &o); err != nil || o.OrderID == "" {
			return bus.Permanent(fmt.Errorf("payload: not an OrderCreated: %s", ev.Payload))
		}
		_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx,
			`INSERT INTO "`+schema+`".billing (order_id, amount_cents, event_id) VALUES ($1, $2, $3)`,
			o.OrderID, o.TotalCents, ev.ID)
		return err
	}
}

// Count returns how many orders were billed.
func Count(ctx context.Context, db *sql.DB, schema string) (int, error) {
	var n int
	err := db.QueryRowContext(ctx, `SELECT count(*) FROM "`+schema+`".billing`).Scan(&n)
	return n, err
}
