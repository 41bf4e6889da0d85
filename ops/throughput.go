package ops

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// ThroughputMinutes is how many minutes Throughput counts: the last hour,
// the current minute included.
const ThroughputMinutes = 60

// Throughput is what the outbox's relays forwarded and the consumer groups
// processed, per minute of the last hour on the database's clock.
type Throughput struct {
	// Start is the start of the first minute. Every list below holds
	// ThroughputMinutes counts from it on, the current minute (still under
	// way) last.
	Start time.Time `json:"start"`
	// Forwarded holds, per relay group (those OutboxStatuses lists), the
	// outbox rows the group has forwarded, each in the minute it was
	// written: the database keeps no time of forwarding, so an event
	// written in one minute and forwarded in a later one counts in the
	// first, once forwarded, and rows still pending count nowhere. Rows the
	// relay's cleanup deleted (forwarded more than relay.retention ago, an
	// hour by default) are missing, the oldest minutes' first; with a
	// retention under an hour, the minutes before it are empty.
	Forwarded map[string][]int64 `json:"forwarded"`
	// Processed holds, per consumer group with inbox rows in the hour, the
	// events its handlers processed per minute: the inbox rows by
	// processed_at (the start of the handler's transaction). Duplicates
	// count once, and handlers with consumer.inbox.enabled false not at all.
	Processed map[string][]int64 `json:"processed"`
}

// Throughput counts the events forwarded per relay group and processed per
// consumer group in each minute of the last hour. Both counts come from one
// transaction, over the same minutes. It reads every outbox row of the
// hour once per relay group, as OutboxStatus reads the whole outbox.
func (c *Client) Throughput(ctx context.Context) (Throughput, error) {
	groups, err := c.relayGroups(ctx)
	if err != nil {
		return Throughput{}, err
	}
	shards, err := c.tables.RecordedShards(ctx, c.db)
	if err != nil {
		return Throughput{}, err
	}
	tx, err := c.db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		return Throughput{}, fmt.Errorf("millrace: begin transaction: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // it only read
	forwarded, err := c.tables.ForwardedPerMinute(ctx, tx, groups, shards, ThroughputMinutes)
	if err != nil {
		return Throughput{}, err
	}
	processed, err := c.tables.ProcessedPerMinute(ctx, tx, ThroughputMinutes)
	if err != nil {
		return Throughput{}, err
	}
	return Throughput{Start: forwarded.Start, Forwarded: forwarded.Counts, Processed: processed.Counts}, nil
}
