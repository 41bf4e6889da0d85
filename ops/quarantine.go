package ops

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

// quarantineQuery is the store query of the quarantine rows f (and ids)
// selects, read as r says.
func quarantineQuery(f Filter, ids []int64, r store.Read) store.QuarantineQuery {
	return store.QuarantineQuery{Read: r, Filter: rowFilter(f, ids)}
}

// check refuses the filter fields the relay quarantine lacks.
func (quarantineTable) check(f Filter) error {
	if f.Handler != "" || f.Group != "" || f.Fingerprint != "" {
		return fmt.Errorf("%w: the relay quarantine has no handlers, consumer groups or failure fingerprints", ErrInvalidFilter)
	}
	return nil
}

// QuarantinedRow is one row of the relay quarantine.
type QuarantinedRow struct {
	ID int64 `json:"id"` // the quarantine row's id (Get, Selection.IDs)
	// OutboxOffset and OutboxUUID identify the outbox row it was.
	OutboxOffset int64  `json:"outbox_offset"`
	OutboxUUID   string `json:"outbox_uuid"` // see OutboxOffset
	// Topic and EventID come from the row's envelope; "" when it is unreadable.
	Topic         string     `json:"topic"`
	EventID       string     `json:"event_id"`       // see Topic
	Reason        string     `json:"reason"`         // why the relay quarantined it
	QuarantinedAt time.Time  `json:"quarantined_at"` // when the relay quarantined it
	ReplayedAt    *time.Time `json:"replayed_at"`    // its last replay; nil if none
	TimesReplayed int        `json:"times_replayed"` // how often it was replayed
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
	Payload  []byte            `json:"payload"` // see Metadata
}

// quarantineTable is the relay quarantine's side of a Table.
type quarantineTable struct {
	rows[store.QuarantineRow, QuarantinedRow, store.QuarantineQuery]
}

// Quarantine returns the relay quarantine. Its Replay writes the selected
// rows back into the outbox as they were (same envelope, so the same event
// id: consumer groups that processed the event already ack it as a
// duplicate), in one transaction, and marks them replayed. A row written by
// a replay from the DLQ is written with the event's own metadata only (see
// DLQ), without the broker headers of the delivery it came from that made
// the relay refuse it. A row whose envelope is unreadable is skipped; so is
// one the configured broker's Rules still refuse, unless opts.Force. A
// replayed row joins the end of the outbox: events of its aggregate
// committed after it were published before it, so a consumer with the
// ordering guard drops it as stale.
func (c *Client) Quarantine() Quarantine {
	return Quarantine{t: quarantineTable{rows[store.QuarantineRow, QuarantinedRow, store.QuarantineQuery]{c: c, what: "quarantined row",
		query: quarantineQuery, read: c.tables.Quarantined, id: func(r store.QuarantineRow) int64 { return r.ID },
		version: quarantineVersion, row: quarantinedRow, del: c.tables.DeleteQuarantined}}}
}

// get returns the quarantined row id with its envelope, or a
// *NotFoundError.
func (q quarantineTable) get(ctx context.Context, id int64) (QuarantinedDetail, error) {
	r, err := q.rows.get(ctx, id)
	if err != nil {
		return QuarantinedDetail{}, err
	}
	d := QuarantinedDetail{QuarantinedRow: quarantinedRow(r), Envelope: r.Payload}
	if _, msg, err := envelope.Unwrap(r.Payload); err != nil {
		d.EnvelopeError = err.Error()
	} else {
		d.Metadata, d.Payload = msg.Metadata, msg.Payload
	}
	return d, nil
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

// QuarantineSkipped is a selected quarantined row that was not replayed.
type QuarantineSkipped struct {
	QuarantinedRow
	// Skip is SkipUnreadable or SkipRefusedByBroker.
	Skip string `json:"skip"`
	// Detail says why.
	Detail string `json:"detail"`
}

// replay is the relay quarantine's Replay in tx.
func (q quarantineTable) replay(ctx context.Context, tx *sql.Tx, sel Selection, opts ReplayOptions, res *ReplayResult[QuarantinedRow, QuarantineSkipped]) error {
	rows, err := q.selected(ctx, tx, sel, true, opts.DryRun, &res.Selection)
	if err != nil {
		return err
	}
	c := q.c
	var outbox []*message.Message
	var ids []int64
	for _, r := range rows {
		payload, ok, err := c.replayable(ctx, tx, r, opts.Force, res)
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
	if err := c.tables.WriteOutbox(ctx, tx, outbox); err != nil {
		return fmt.Errorf("millrace: %w", err)
	}
	return c.tables.MarkQuarantineReplayed(ctx, tx, ids)
}

// replayable returns the outbox payload that replays r, and false when r
// cannot be replayed, recording in res why not (or, with force, that the
// broker will refuse it again). The payload is r's, except that a row
// written by a replay from the poison table carries only the event's own
// metadata and its replay markers (ownMetadataOfReplay): one written
// before replays did so carries its delivery's broker headers, which the
// relay refuses, and names no consumer groups, which the replay history
// (read in tx) does.
func (c *Client) replayable(ctx context.Context, tx *sql.Tx, r store.QuarantineRow, force bool, res *ReplayResult[QuarantinedRow, QuarantineSkipped]) ([]byte, bool, error) {
	row := quarantinedRow(r)
	rules := c.cfg.Broker.Rules()
	topic, msg, err := envelope.Unwrap(r.Payload)
	if err != nil {
		res.Skipped = append(res.Skipped, QuarantineSkipped{QuarantinedRow: row, Skip: SkipUnreadable, Detail: err.Error()})
		return nil, false, nil
	}
	payload := r.Payload
	if replayOfDLQ(msg) {
		var groups []string
		if _, named := msg.Metadata[middleware.ReplayGroupsKey]; !named {
			if groups, err = c.tables.ReplayedGroups(ctx, tx, msg.UUID); err != nil {
				return nil, false, err
			}
		}
		if payload, err = ownMetadataOfReplay(topic, msg, c.cfg.Broker, groups); err != nil {
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
		r.ID, c.cfg.Broker.Kind, err))
	return payload, true, nil
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
