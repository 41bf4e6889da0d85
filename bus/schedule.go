package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/millrace-io/millrace/internal/store"
)

// When is when a scheduled event is due: DueAt a time, or DueIn a delay.
// The zero When is refused.
type When struct {
	at    time.Time
	delay time.Duration
	kind  whenKind
}

type whenKind int

const (
	whenUnset whenKind = iota
	whenAt
	whenIn
)

// DueAt is due at t. t must not be zero; a t in the past is due at once.
// The relay compares it with the database's clock.
func DueAt(t time.Time) When { return When{at: t, kind: whenAt} }

// DueIn is due d after the event is written, by the database's clock (so
// a clock difference between the service and PostgreSQL does not move
// it). d must not be negative; 0 is due at once.
func DueIn(d time.Duration) When { return When{delay: d, kind: whenIn} }

// ErrInvalidSchedule is matched (errors.Is) by the *ScheduleError of a
// Schedule given a due time it cannot use.
var ErrInvalidSchedule = errors.New("millrace: invalid schedule")

// ErrNotScheduled: CancelScheduled found no such scheduled event. Its id is
// unknown, it was cancelled already, or it was due and the relay moved it
// into the outbox, from where it is published.
var ErrNotScheduled = errors.New("millrace: no such scheduled event (unknown id, cancelled already, or already due and in the outbox)")

// uniqueViolation is PostgreSQL's SQLSTATE unique_violation.
const uniqueViolation = "23505"

// ErrAlreadyScheduled: Schedule was given the id of an event that is
// scheduled already (and not yet due). The failed INSERT has aborted the
// transaction, as any failed statement does in PostgreSQL: roll it back.
var ErrAlreadyScheduled = errors.New("millrace: an event with this id is scheduled already")

// ScheduleError says which part of a When is wrong: "At" (a zero time),
// "Delay" (a negative one) or "When" (the zero When). Nothing was written.
type ScheduleError struct {
	// Field is "At", "Delay" or "When".
	Field string
	// Detail says what was wrong.
	Detail string
}

func (e *ScheduleError) Error() string {
	return fmt.Sprintf("%v: %s: %s", ErrInvalidSchedule, e.Field, e.Detail)
}

// Unwrap returns ErrInvalidSchedule.
func (e *ScheduleError) Unwrap() error { return ErrInvalidSchedule }

// Permanent is true: the same When is refused again.
func (e *ScheduleError) Permanent() bool { return true }

func (w When) check() error {
	switch w.kind {
	case whenUnset:
		return &ScheduleError{Field: "When", Detail: "no due time: use bus.DueAt(t) or bus.DueIn(d)"}
	case whenIn:
		if w.delay < 0 {
			return &ScheduleError{Field: "Delay", Detail: fmt.Sprintf("must not be negative; got %s", w.delay)}
		}
	case whenAt:
		if w.at.IsZero() {
			return &ScheduleError{Field: "At", Detail: "the due time is the zero time.Time"}
		}
		if y := w.at.UTC().Year(); y < 1 || y > 9999 {
			return &ScheduleError{Field: "At", Detail: fmt.Sprintf("year %d is outside 0001-9999", y)}
		}
	}
	return nil
}

// Schedule writes events for topic within tx, the caller's transaction, to
// be published when they are due: if tx commits, the relay moves them into
// the outbox at their due time (events due at the same time in the order
// given), and from there they are published like any other event. It
// returns the events' ids, what CancelScheduled takes. Every event is
// checked as Publish checks it, and when; on any error nothing is written.
//
// A scheduled event enters the outbox when it is due and is ordered from
// then on: an event of the same aggregate published (committed) before that
// moment leaves before it, one published after leaves after it. Events due
// already never wait for scheduled ones, and scheduled ones never hold back
// the outbox. With consumer.ordering_guard, give a scheduled event an
// aggregate version of 0 (none), or one above every version published until
// it is due: the guard drops an event older than what it applied.
//
// tx is what Publish takes: a *sql.Tx, bus.Pgx(tx) for a pgx.Tx, or a
// handler's Tx[Execer](ctx).
func (b *Bus) Schedule(ctx context.Context, tx Execer, topic string, when When, events ...Event) ([]string, error) {
	if isNil(tx) {
		return nil, ErrNilTx
	}
	if err := when.check(); err != nil {
		return nil, err
	}
	rows, ids, err := b.outboxRows(ctx, topic, events)
	if err != nil || len(rows) == 0 {
		return nil, err
	}
	scheduled := make([]store.Scheduled, len(rows))
	seen := make(map[string]bool, len(ids))
	for i, row := range rows {
		e := events[i]
		if seen[ids[i]] {
			return nil, &EventError{Index: i, Type: e.Type, Field: "ID", Kind: ErrInvalidField,
				Detail: fmt.Sprintf("event id %q is given twice: a scheduled event is cancelled by its id, which must be unique", ids[i])}
		}
		seen[ids[i]] = true
		scheduled[i] = store.Scheduled{ID: ids[i], At: when.at, Delay: when.delay, Row: row,
			Topic: topic, Type: e.Type, AggregateType: e.AggregateType, AggregateID: e.AggregateID}
	}
	if err := b.tables.WriteScheduled(ctx, tx, scheduled); err != nil {
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == uniqueViolation {
			return nil, fmt.Errorf("%w: %w", ErrAlreadyScheduled, err)
		}
		return nil, fmt.Errorf("millrace: %w", err)
	}
	return ids, nil
}

// CancelScheduled deletes the scheduled event id within tx, so that it is
// never published if tx commits. It returns ErrNotScheduled when there is
// no such event: the id is unknown, it was cancelled already, or it was
// due and the relay has moved it into the outbox (it will be published).
// An event whose due time has passed but which the relay has not moved yet
// is still cancelled. tx is what Publish takes.
func (b *Bus) CancelScheduled(ctx context.Context, tx Execer, id string) error {
	if isNil(tx) {
		return ErrNilTx
	}
	if err := b.checkOpen(); err != nil {
		return err
	}
	found, err := b.tables.CancelScheduled(ctx, tx, id)
	switch {
	case err != nil:
		return fmt.Errorf("millrace: %w", err)
	case !found:
		return fmt.Errorf("%w: %q", ErrNotScheduled, id)
	}
	return nil
}

// Schedule writes values within tx to be published when they are due, as
// Bus.Schedule does with the events Publish would write for them.
func (t *Topic[T]) Schedule(ctx context.Context, b *Bus, tx Execer, when When, values ...T) ([]string, error) {
	if b == nil {
		return nil, errNilBus
	}
	events, err := t.events(values)
	if err != nil {
		return nil, err
	}
	return b.Schedule(ctx, tx, t.name, when, events...)
}
