package ops

import (
	"context"
	"fmt"
	"time"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
)

// ScheduledEvent is an event waiting for its due time (Bus.Schedule).
type ScheduledEvent struct {
	// ID is the event id, what CancelScheduled takes.
	ID string `json:"id"`
	// Topic is the destination topic.
	Topic         string    `json:"topic"`
	Type          string    `json:"type"`           // the event's type
	AggregateType string    `json:"aggregate_type"` // the event's aggregate type
	AggregateID   string    `json:"aggregate_id"`   // the event's aggregate id
	DueAt         time.Time `json:"due_at"`         // when it is due
	// ScheduledAt is when the transaction that scheduled it began.
	ScheduledAt time.Time `json:"scheduled_at"`
}

// ScheduledList is a page of scheduled events.
type ScheduledList struct {
	Events []ScheduledEvent `json:"events"` // the events of the page
	// Total counts every scheduled event.
	Total int64 `json:"total"`
	// Truncated says more events are scheduled than the limit.
	Truncated bool `json:"truncated"`
}

// ListScheduled lists the scheduled events, the soonest due first, at most
// limit of them (0: all).
func (c *Client) ListScheduled(ctx context.Context, limit int) (ScheduledList, error) {
	read, err := listLimit(limit)
	if err != nil {
		return ScheduledList{}, err
	}
	if read == 0 {
		read = -1
	}
	rows, total, err := c.tables.ListScheduled(ctx, c.db, read)
	if err != nil {
		return ScheduledList{}, err
	}
	res := ScheduledList{Total: total}
	res.Events, res.Truncated = page(rows, scheduledEvent, limit)
	return res, nil
}

// ScheduledEvents returns those of the events ids that are still
// scheduled, the soonest due first: an id that is not (due and moved into
// the outbox, or cancelled) is left out. A saga instance's Timeouts are
// such ids.
func (c *Client) ScheduledEvents(ctx context.Context, ids ...string) ([]ScheduledEvent, error) {
	rows, err := c.tables.ScheduledByID(ctx, c.db, ids)
	if err != nil {
		return nil, fmt.Errorf("millrace: %w", err)
	}
	events, _ := page(rows, scheduledEvent, 0)
	return events, nil
}

func scheduledEvent(r store.ScheduledRow) ScheduledEvent {
	return ScheduledEvent{ID: r.ID, Topic: r.Topic, Type: r.Type, AggregateType: r.AggregateType,
		AggregateID: r.AggregateID, DueAt: r.DueAt, ScheduledAt: r.ScheduledAt}
}

// CancelScheduled deletes the scheduled event id in a transaction of its
// own, as Bus.CancelScheduled does in the caller's: it returns an error
// matching bus.ErrNotScheduled when there is no such event.
func (c *Client) CancelScheduled(ctx context.Context, id string) error {
	found, err := c.tables.CancelScheduled(ctx, c.db, id)
	switch {
	case err != nil:
		return fmt.Errorf("millrace: %w", err)
	case !found:
		return fmt.Errorf("%w: %q", bus.ErrNotScheduled, id)
	}
	return nil
}
