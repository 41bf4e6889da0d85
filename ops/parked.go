package ops

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/millrace-io/millrace/internal/store"
)

// Parked aggregate states (ParkedAggregate.State).
const (
	// ParkStateHeld: its poisoned message waits for a replay or a skip;
	// the aggregate's later messages are parked behind it.
	ParkStateHeld = "held"
	// ParkStateDraining: the poisoned message was replayed or skipped; a
	// consumer of the group hands the parked messages to the handler, in
	// order, and the park goes once they are through.
	ParkStateDraining = "draining"
)

// ParkedAggregate is an order key (an aggregate, or a saga's correlation
// id) an ordered handler's consumer group holds parked behind a poisoned
// message (consumer.poison.park).
type ParkedAggregate struct {
	ConsumerGroup string `json:"consumer_group"` // the group that parked it
	Handler       string `json:"handler"`        // its handler
	Key           string `json:"key"`            // the order key: aggregate id, or Handler.OrderKey's
	Topic         string `json:"topic"`          // the handler's topic
	State         string `json:"state"`          // ParkStateHeld or ParkStateDraining
	// PoisonID is the DLQ row of the poisoned message holding it: replay
	// or skip that row to release the aggregate.
	PoisonID int64 `json:"poison_id"`
	// Parked counts the messages held, the poisoned one included while it
	// waits.
	Parked     int        `json:"parked"`
	Since      time.Time  `json:"since"`       // when it was parked
	ReleasedAt *time.Time `json:"released_at"` // when it was replayed or skipped; nil while held
	// DrainedBy names the consumer (host/pid/id) draining it; "" when none.
	DrainedBy string `json:"drained_by"`
}

// ParkedFilter selects parked aggregates; the zero filter selects all.
type ParkedFilter struct {
	Group, Handler, Key string
	// State is ParkStateHeld, ParkStateDraining or "" for both.
	State string
}

// Parked lists the parked aggregates f selects, the longest parked first,
// at most limit of them (0: all). A State other than those there are is
// ErrInvalidFilter.
func (c *Client) Parked(ctx context.Context, f ParkedFilter, limit int) (List[ParkedAggregate], error) {
	state := ""
	switch f.State {
	case "":
	case ParkStateHeld:
		state = store.ParkHeld
	case ParkStateDraining:
		state = store.ParkReleased
	default:
		return List[ParkedAggregate]{}, fmt.Errorf("%w: state %q: want %q or %q", ErrInvalidFilter, f.State, ParkStateHeld, ParkStateDraining)
	}
	read, err := listLimit(limit)
	if err != nil {
		return List[ParkedAggregate]{}, err
	}
	parks, err := c.tables.Parks(ctx, c.db, store.ParkFilter{Group: f.Group, Handler: f.Handler, Key: f.Key, State: state}, read)
	if err != nil {
		return List[ParkedAggregate]{}, fmt.Errorf("millrace: %w", err)
	}
	var res List[ParkedAggregate]
	res.Rows, res.Truncated = page(parks, parkedAggregate, limit)
	return res, nil
}

func parkedAggregate(p store.Park) ParkedAggregate {
	a := ParkedAggregate{ConsumerGroup: p.Group, Handler: p.Handler, Key: p.Key, Topic: p.Topic, State: ParkStateHeld,
		PoisonID: p.PoisonID, Parked: p.Parked, Since: p.ParkedAt, ReleasedAt: p.ReleasedAt, DrainedBy: p.LeaseOwner}
	if p.State == store.ParkReleased {
		a.State = ParkStateDraining
	}
	return a
}

// releaseParked releases in tx the parks that rows hold, as a replay does
// (unless opts.DryRun): each such row's poisoned message goes to its
// handler from the parked table, ahead of its aggregate's parked messages,
// with no outbox message and no broker round trip. It returns the other
// rows, for the outbox.
func (c *Client) releaseParked(ctx context.Context, tx *sql.Tx, rows []store.PoisonRow, opts ReplayOptions,
	res *ReplayResult[ReplayedEntry, SkippedEntry]) ([]store.PoisonRow, error) {
	if len(rows) == 0 {
		return rows, nil
	}
	held, err := c.tables.HeldParks(ctx, tx, poisonIDs(rows))
	if err != nil || len(held) == 0 {
		return rows, err
	}
	var rest []store.PoisonRow
	var ids []int64
	var messageIDs []string
	for _, r := range rows {
		if !held[r.ID] {
			rest = append(rest, r)
			continue
		}
		e := ReplayedEntry{ID: r.ID, ConsumerGroup: r.ConsumerGroup, Handler: r.Handler, Topic: r.Topic, EventID: r.EventID,
			EventType: r.EventType, TargetGroups: []string{r.ConsumerGroup}, Parked: true}
		if !opts.DryRun {
			e.MessageID = r.MessageID
		}
		res.Replayed = append(res.Replayed, e)
		ids, messageIDs = append(ids, r.ID), append(messageIDs, r.MessageID)
	}
	if opts.DryRun {
		return rest, nil
	}
	if err := c.tables.ReleaseParks(ctx, tx, ids, false); err != nil {
		return nil, fmt.Errorf("millrace: %w", err)
	}
	if err := c.tables.MarkPoisonReplayed(ctx, tx, ids, messageIDs, cmp.Or(opts.By, "unknown")); err != nil {
		return nil, fmt.Errorf("millrace: %w", err)
	}
	return rest, nil
}

func poisonIDs(rows []store.PoisonRow) []int64 {
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.ID
	}
	return ids
}

// SkipResult is what a skip did (with DryRun: would do).
type SkipResult[R any] struct {
	// DryRun says nothing changed: the result is what would be done.
	DryRun bool `json:"dry_run"`
	// Selection is a token of the selected rows and their state, for
	// Selection.Expect.
	Selection string `json:"selection"`
	// Skipped are the rows marked skipped; with DryRun, those that would be.
	Skipped []R `json:"skipped"`
	// Released counts the parked aggregates the skipped rows held: their
	// parked messages flow on without the skipped one.
	Released int `json:"released"`
}

// ErrNotSupported is matched by the error of an action a table does not
// have: the relay quarantine has no Skip.
var ErrNotSupported = errors.New("millrace: not supported by this table")

// skipper is a table that can skip rows: the DLQ.
type skipper[R any] interface {
	skip(ctx context.Context, tx *sql.Tx, sel Selection, dryRun bool, res *SkipResult[R]) error
}

// Skip gives up on the selected poisoned messages for good, in one
// transaction: each row is marked skipped (state PoisonStateSkipped until
// it is poisoned again) and is not replayed, and a parked aggregate a row
// holds is released without it: its parked messages go to the handler in
// order. The DLQ only; the relay quarantine's Skip is ErrNotSupported. A
// selected id that does not exist is a *NotFoundError, and nothing changes.
func (t Table[R, D, E, S]) Skip(ctx context.Context, sel Selection, dryRun bool) (SkipResult[R], error) {
	res := SkipResult[R]{DryRun: dryRun, Skipped: []R{}}
	sk, ok := t.t.(skipper[R])
	if !ok {
		return res, fmt.Errorf("%w: only poisoned messages (the DLQ) can be skipped", ErrNotSupported)
	}
	if err := t.checkSelection(sel); err != nil {
		return res, err
	}
	err := t.t.client().inTx(ctx, dryRun, "skip", func(tx *sql.Tx) error {
		return sk.skip(ctx, tx, sel, dryRun, &res)
	})
	return res, err
}

// skip is the DLQ's Skip in tx.
func (p poisonTable) skip(ctx context.Context, tx *sql.Tx, sel Selection, dryRun bool, res *SkipResult[PoisonedMessage]) error {
	rows, err := p.selected(ctx, tx, sel, false, dryRun, &res.Selection)
	if err != nil || len(rows) == 0 {
		return err
	}
	ids := poisonIDs(rows)
	held, err := p.c.tables.HeldParks(ctx, tx, ids)
	if err != nil {
		return fmt.Errorf("millrace: %w", err)
	}
	res.Released = len(held)
	res.Skipped, _ = page(rows, poisonedMessage, 0)
	if dryRun {
		return nil
	}
	if err := p.c.tables.ReleaseParks(ctx, tx, ids, true); err != nil {
		return fmt.Errorf("millrace: %w", err)
	}
	return nil
}
