package bus

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/middleware"
)

// The relay quarantine holds outbox rows the relay could not publish and no
// retry would: an unreadable envelope, a message the broker refuses (a
// reserved header, over its size limit, an invalid topic, a topology that
// conflicts with the config). Once the cause is fixed (the stream or queue
// changed, the config raised a limit), a replay writes the row back into the
// outbox as it was, so its event keeps its id.

// QuarantineFilter selects quarantined rows; the zero filter selects all.
type QuarantineFilter struct {
	// Topic matches the row's destination topic.
	Topic string
	// Reason matches rows whose reason contains it, case-insensitively.
	Reason string
	// Since and Until bound when the row was quarantined: Since <= t < Until.
	Since, Until TimeBound
	// Replayed, when set, selects rows replayed (true) or not (false).
	Replayed *bool
}

// IsZero reports whether f selects every row.
func (f QuarantineFilter) IsZero() bool {
	return f.Topic == "" && f.Reason == "" && f.Since.IsZero() && f.Until.IsZero() && f.Replayed == nil
}

func (f QuarantineFilter) store(ids []int64) store.QuarantineFilter {
	return store.QuarantineFilter{IDs: ids, Topic: f.Topic, Reason: f.Reason, Since: f.Since.b, Until: f.Until.b, Replayed: f.Replayed}
}

// QuarantinedRow is one row of the relay quarantine.
type QuarantinedRow struct {
	ID int64 `json:"id"`
	// OutboxOffset and OutboxUUID identify the outbox row it was.
	OutboxOffset int64  `json:"outbox_offset"`
	OutboxUUID   string `json:"outbox_uuid"`
	// Topic and EventID come from the row's envelope; "" when it is unreadable.
	Topic         string     `json:"topic"`
	EventID       string     `json:"event_id"`
	Reason        string     `json:"reason"`
	QuarantinedAt time.Time  `json:"quarantined_at"`
	ReplayedAt    *time.Time `json:"replayed_at"`
	TimesReplayed int        `json:"times_replayed"`
	// PayloadBytes is the size of the outbox row's payload (the envelope).
	PayloadBytes int `json:"payload_bytes"`
}

func quarantinedRow(r store.QuarantineRow) QuarantinedRow {
	return QuarantinedRow{ID: r.ID, OutboxOffset: r.OutboxOffset, OutboxUUID: r.OutboxUUID, Topic: r.Topic,
		EventID: r.EventID, Reason: r.Reason, QuarantinedAt: r.QuarantinedAt, ReplayedAt: r.ReplayedAt,
		TimesReplayed: r.TimesReplayed, PayloadBytes: r.PayloadBytes}
}

// QuarantinedDetail is a quarantined row with its envelope read, if it can be.
type QuarantinedDetail struct {
	QuarantinedRow
	// Envelope is the outbox row's payload as it was written.
	Envelope []byte `json:"envelope"`
	// EnvelopeError says why the envelope cannot be read; "" when it can.
	EnvelopeError string `json:"envelope_error"`
	// Metadata and Payload are the event's, from the envelope.
	Metadata map[string]string `json:"metadata"`
	Payload  []byte            `json:"payload"`
}

// QuarantineList is a page of quarantined rows.
type QuarantineList struct {
	Rows []QuarantinedRow `json:"rows"`
	// Truncated says more rows match than the limit.
	Truncated bool `json:"truncated"`
}

// ListQuarantined lists the quarantined rows f selects, newest first, at
// most limit of them (0: all).
func (o *Ops) ListQuarantined(ctx context.Context, f QuarantineFilter, limit int) (QuarantineList, error) {
	read, err := listLimit(limit)
	if err != nil {
		return QuarantineList{}, err
	}
	rows, err := o.tables.Quarantined(ctx, o.db, store.QuarantineQuery{Filter: f.store(nil), NewestFirst: true, Limit: read})
	if err != nil {
		return QuarantineList{}, err
	}
	var res QuarantineList
	res.Rows, res.Truncated = page(rows, quarantinedRow, limit)
	return res, nil
}

// Quarantined returns the quarantined row id with its envelope, or a
// *NotFoundError.
func (o *Ops) Quarantined(ctx context.Context, id int64) (QuarantinedDetail, error) {
	rows, err := o.tables.Quarantined(ctx, o.db, store.QuarantineQuery{Filter: store.QuarantineFilter{IDs: []int64{id}}, Full: true})
	if err != nil {
		return QuarantinedDetail{}, err
	}
	if len(rows) == 0 {
		return QuarantinedDetail{}, &NotFoundError{What: "quarantined row", IDs: []int64{id}}
	}
	r := rows[0]
	d := QuarantinedDetail{QuarantinedRow: quarantinedRow(r), Envelope: r.Payload}
	if _, msg, err := envelope.Unwrap(r.Payload); err != nil {
		d.EnvelopeError = err.Error()
	} else {
		d.Metadata, d.Payload = msg.Metadata, msg.Payload
	}
	return d, nil
}

// QuarantineSelection is what a replay or purge of quarantined rows acts
// on: IDs, a Filter, or All, exactly one of them.
type QuarantineSelection struct {
	IDs    []int64
	Filter QuarantineFilter
	All    bool
	// Limit acts on at most this many matching rows, oldest first (with
	// Filter or All; 0: no limit).
	Limit int
	// Expect, when set, is the Selection token of an earlier result (a dry
	// run's): the action goes ahead only if the selection still holds
	// exactly those rows in the same state, and is a *ChangedError
	// otherwise, changing nothing.
	Expect string
}

func (s QuarantineSelection) query(lock bool) (store.QuarantineQuery, error) {
	if err := selectionError(s.IDs, !s.Filter.IsZero(), s.All, s.Limit); err != nil {
		return store.QuarantineQuery{}, err
	}
	return store.QuarantineQuery{Filter: s.Filter.store(s.IDs), Limit: s.Limit, Full: true, Lock: lock}, nil
}

// Reasons a quarantined row is not replayed.
const (
	// SkipUnreadable: its envelope cannot be read; a replay would be
	// quarantined again. Purge it, or write the event anew.
	SkipUnreadable = "unreadable"
	// SkipRefusedByBroker: the configured broker still refuses it (its
	// Rules); fix the cause, or replay with Force.
	SkipRefusedByBroker = "refused_by_broker"
)

// QuarantineReplayResult is what a replay of quarantined rows did (with
// DryRun: would do).
type QuarantineReplayResult struct {
	DryRun bool `json:"dry_run"`
	// Selection is a token of the selected rows and their state, for
	// QuarantineSelection.Expect.
	Selection string              `json:"selection"`
	Replayed  []QuarantinedRow    `json:"replayed"`
	Skipped   []QuarantineSkipped `json:"skipped"`
	// Messages counts the rows written to the outbox (with DryRun: that would be).
	Messages int      `json:"messages"`
	Warnings []string `json:"warnings"`
}

// QuarantineSkipped is a selected quarantined row that was not replayed.
type QuarantineSkipped struct {
	QuarantinedRow
	// Skip is SkipUnreadable or SkipRefusedByBroker.
	Skip string `json:"skip"`
	// Detail says why.
	Detail string `json:"detail"`
}

// ReplayQuarantined writes the selected quarantined rows back into the
// outbox as they were (same envelope, so the same event id: consumer groups
// that processed the event already ack it as a duplicate), in one
// transaction, and marks them replayed. A row written by a replay from the
// poison table is written with the event's own metadata only (see
// ReplayPoisoned), without the broker headers of the delivery it came from
// that made the relay refuse it. A row whose envelope is unreadable
// is skipped; so is one the configured broker's Rules still refuse, unless
// opts.Force. A selected id that does not exist is a *NotFoundError, and
// nothing changes. A replayed row joins the end of the outbox: events of its
// aggregate committed after it were published before it, so a consumer with
// the ordering guard drops it as stale.
func (o *Ops) ReplayQuarantined(ctx context.Context, sel QuarantineSelection, opts ReplayOptions) (QuarantineReplayResult, error) {
	res := QuarantineReplayResult{DryRun: opts.DryRun, Replayed: []QuarantinedRow{}, Skipped: []QuarantineSkipped{}, Warnings: []string{}}
	q, err := sel.query(!opts.DryRun)
	if err != nil {
		return res, err
	}
	err = o.inTx(ctx, opts.DryRun, "replay", func(tx *sql.Tx) error {
		rows, err := o.tables.Quarantined(ctx, tx, q)
		if err != nil {
			return err
		}
		if err := missingIDs("quarantined row", sel.IDs, foundQuarantined(rows)); err != nil {
			return err
		}
		if res.Selection, err = checkSelection("quarantined row", rows, quarantineVersion, sel.Expect); err != nil {
			return err
		}
		var outbox []*message.Message
		var ids []int64
		for _, r := range rows {
			payload, ok, err := o.replayable(ctx, tx, r, opts.Force, &res)
			if err != nil {
				return err
			}
			if !ok {
				continue
			}
			res.Replayed = append(res.Replayed, quarantinedRow(r))
			ids = append(ids, r.ID)
			outbox = append(outbox, message.NewMessage(r.OutboxUUID, payload))
		}
		res.Messages = len(outbox)
		if opts.DryRun || len(ids) == 0 {
			return nil
		}
		if err := o.tables.WriteOutbox(ctx, tx, outbox); err != nil {
			return fmt.Errorf("millrace: %w", err)
		}
		return o.tables.MarkQuarantineReplayed(ctx, tx, ids)
	})
	return res, err
}

// replayable returns the outbox payload that replays r, and false when r
// cannot be replayed, recording in res why not (or, with force, that the
// broker will refuse it again). The payload is r's, except that a row
// written by a replay from the poison table carries only the event's own
// metadata and its replay markers (ownMetadataOfReplay): one written
// before replays did so carries its delivery's broker headers, which the
// relay refuses, and names no consumer groups, which the replay history
// (read in tx) does.
func (o *Ops) replayable(ctx context.Context, tx *sql.Tx, r store.QuarantineRow, force bool, res *QuarantineReplayResult) ([]byte, bool, error) {
	row := quarantinedRow(r)
	rules := o.cfg.Broker.Rules()
	topic, msg, err := envelope.Unwrap(r.Payload)
	if err != nil {
		res.Skipped = append(res.Skipped, QuarantineSkipped{QuarantinedRow: row, Skip: SkipUnreadable, Detail: err.Error()})
		return nil, false, nil
	}
	payload := r.Payload
	if replayOfDLQ(msg) {
		var groups []string
		if _, named := msg.Metadata[middleware.ReplayGroupsKey]; !named {
			if groups, err = o.tables.ReplayedGroups(ctx, tx, msg.UUID); err != nil {
				return nil, false, err
			}
		}
		if payload, err = ownMetadataOfReplay(topic, msg, rules, groups); err != nil {
			return nil, false, fmt.Errorf("millrace: quarantined row %d: %w", r.ID, err)
		}
	}
	err = rules.CheckMessage(topic, msg)
	var refused *adapters.RefusedError
	switch {
	case err == nil:
		return payload, true, nil
	case !force || !errors.As(err, &refused):
		res.Skipped = append(res.Skipped, QuarantineSkipped{QuarantinedRow: row, Skip: SkipRefusedByBroker, Detail: err.Error()})
		return nil, false, nil
	}
	res.Warnings = append(res.Warnings, fmt.Sprintf("row %d is still refused by broker.kind %s (%v); replayed because of Force, the relay will quarantine it again",
		r.ID, o.cfg.Broker.Kind, err))
	return payload, true, nil
}

func foundQuarantined(rows []store.QuarantineRow) map[int64]bool {
	found := make(map[int64]bool, len(rows))
	for _, r := range rows {
		found[r.ID] = true
	}
	return found
}

// QuarantinePurgeResult is what a purge of quarantined rows did (with
// DryRun: would do).
type QuarantinePurgeResult struct {
	DryRun bool `json:"dry_run"`
	// Selection is a token of the selected rows and their state, for
	// QuarantineSelection.Expect.
	Selection string `json:"selection"`
	// Purged are the rows deleted; with DryRun, those that would be.
	Purged []QuarantinedRow `json:"purged"`
}

// PurgeQuarantined deletes the selected quarantined rows, in one
// transaction. A selected id that does not exist is a *NotFoundError, and
// nothing changes.
func (o *Ops) PurgeQuarantined(ctx context.Context, sel QuarantineSelection, dryRun bool) (QuarantinePurgeResult, error) {
	res := QuarantinePurgeResult{DryRun: dryRun, Purged: []QuarantinedRow{}}
	q, err := sel.query(!dryRun)
	if err != nil {
		return res, err
	}
	q.Full = false
	err = o.inTx(ctx, dryRun, "purge", func(tx *sql.Tx) error {
		rows, err := o.tables.Quarantined(ctx, tx, q)
		if err != nil {
			return err
		}
		if err := missingIDs("quarantined row", sel.IDs, foundQuarantined(rows)); err != nil {
			return err
		}
		if res.Selection, err = checkSelection("quarantined row", rows, quarantineVersion, sel.Expect); err != nil {
			return err
		}
		ids := make([]int64, len(rows))
		for i, r := range rows {
			ids[i] = r.ID
		}
		if len(ids) > 0 && !dryRun {
			if err := o.tables.DeleteQuarantined(ctx, tx, ids); err != nil {
				return fmt.Errorf("millrace: %w", err)
			}
		}
		res.Purged, _ = page(rows, quarantinedRow, 0)
		return nil
	})
	return res, err
}

// quarantineVersion is what identifies a quarantined row's state: a replay
// changes it.
func quarantineVersion(r store.QuarantineRow) string {
	v := fmt.Sprintf("%d/%d", r.ID, r.TimesReplayed)
	if r.ReplayedAt != nil {
		v += "/r" + strconv.FormatInt(r.ReplayedAt.UnixNano(), 10)
	}
	return v
}
