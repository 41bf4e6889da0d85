package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ScheduledNotifyChannel is the LISTEN/NOTIFY channel the scheduled table's
// trigger signals on commit of a new scheduled message; the payload is the
// schema, so that the scheduler recomputes its next wake-up.
const ScheduledNotifyChannel = "millrace_scheduled"

// ScheduledTable is the qualified table of scheduled messages: outbox rows
// held back until their due time, then moved into the outbox by MoveDue.
func (t Tables) ScheduledTable() string { return t.qualify("millrace_scheduled") }

// Scheduled is one message to schedule: the outbox row Publish would write
// (Row, a forwarder envelope), when it is due, and what a listing shows.
type Scheduled struct {
	// ID is the event id, what CancelScheduled takes.
	ID string
	// At is the due time; when zero, Delay from the database's clock is.
	At time.Time
	// Delay is the due time relative to the database's clock at the write,
	// used when At is zero.
	Delay time.Duration
	// Row is the outbox row to write once due.
	Row *message.Message
	// Topic, Type, AggregateType and AggregateID describe the event for
	// listings.
	Topic, Type, AggregateType, AggregateID string
}

// scheduledColumns are the columns WriteScheduled fills, in order.
const scheduledColumns = `outbox_topic, id, due_at, destination_topic, event_type, aggregate_type, aggregate_id, outbox_uuid, payload, metadata`

// scheduledInsert builds the INSERT of rows into the scheduled table (at
// most scheduledPerInsert rows).
func (t Tables) scheduledInsert(rows []Scheduled) (string, []any, error) {
	var b strings.Builder
	b.WriteString(`INSERT INTO ` + t.ScheduledTable() + ` (` + scheduledColumns + `) VALUES `)
	args := make([]any, 0, len(rows)*10)
	for i, r := range rows {
		metadata, err := json.Marshal(r.Row.Metadata)
		if err != nil {
			return "", nil, fmt.Errorf("marshal metadata of scheduled message %s: %w", r.ID, err)
		}
		var at any // NULL: the due time is the delay from the database's clock
		if !r.At.IsZero() {
			at = r.At
		}
		if i > 0 {
			b.WriteString(",")
		}
		n := len(args)
		p := func(k int) string { return "$" + strconv.Itoa(n+k) }
		fmt.Fprintf(&b, "(%s,%s,coalesce(%s::timestamptz, clock_timestamp() + make_interval(secs => %s::float8)),%s,%s,%s,%s,%s,%s,%s)",
			p(1), p(2), p(3), p(4), p(5), p(6), p(7), p(8), p(9), p(10), p(11))
		args = append(args, t.OutboxTopic, r.ID, at, r.Delay.Seconds(), r.Topic, r.Type, r.AggregateType, r.AggregateID,
			r.Row.UUID, string(r.Row.Payload), string(metadata)) // text for the JSON columns, in every query exec mode: see jsonArgs
	}
	return b.String(), args, nil
}

// scheduledPerInsert bounds one scheduled INSERT: eleven parameters per
// row, and PostgreSQL allows 65535 per statement.
const scheduledPerInsert = 5000

// WriteScheduled inserts rows into the scheduled table in tx, the caller's
// transaction: they move into the outbox at their due time if tx commits.
func (t Tables) WriteScheduled(ctx context.Context, tx Execer, rows []Scheduled) error {
	for start := 0; start < len(rows); start += scheduledPerInsert {
		chunk := rows[start:min(start+scheduledPerInsert, len(rows))]
		q, args, err := t.scheduledInsert(chunk)
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, q, args...); err != nil {
			return fmt.Errorf("schedule %d events in %s: %w", len(chunk), t.ScheduledTable(), err)
		}
	}
	return nil
}

// CancelScheduled deletes the scheduled message id in tx and reports
// whether it was there: false when the id is unknown, was cancelled
// already, or has been moved into the outbox (it is due). A cancel that
// meets the message while MoveDue is moving it waits for that move and
// then finds nothing, so a message cancelled without error is never
// published.
func (t Tables) CancelScheduled(ctx context.Context, tx Execer, id string) (bool, error) {
	res, err := tx.ExecContext(ctx, `DELETE FROM `+t.ScheduledTable()+` WHERE outbox_topic = $1 AND id = $2`, t.OutboxTopic, id)
	if err != nil {
		return false, fmt.Errorf("cancel scheduled message %s: %w", id, err)
	}
	n, err := res.RowsAffected()
	return n > 0, err
}

// MoveDue moves up to limit scheduled messages that are due (by the
// database's clock) into the outbox, in one transaction: deleted from the
// scheduled table and inserted into the outbox in due order, so that a crash
// loses none and duplicates none. Rows another mover holds are skipped (FOR
// UPDATE SKIP LOCKED), so several relays may run it at once. It returns how
// many it moved and how long until the next scheduled message is due
// (negative when one is due already; ok false when none is scheduled).
func (t Tables) MoveDue(ctx context.Context, db *sql.DB, limit int) (moved int, next time.Duration, ok bool, err error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, 0, false, fmt.Errorf("begin moving due messages: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	res, err := tx.ExecContext(ctx, t.relaySQL(`
		WITH due AS (
			DELETE FROM `+t.ScheduledTable()+` s WHERE (s.outbox_topic, s.id) IN (
				SELECT outbox_topic, id FROM `+t.ScheduledTable()+`
				WHERE outbox_topic = $1 AND due_at <= clock_timestamp()
				ORDER BY due_at, seq LIMIT $2 FOR UPDATE SKIP LOCKED)
			RETURNING s.outbox_uuid, s.payload, s.metadata, s.due_at, s.seq)
		INSERT INTO `+t.OutboxTable()+` (uuid, payload, metadata, transaction_id)
		SELECT outbox_uuid, payload, metadata, pg_current_xact_id() FROM due ORDER BY due_at, seq`),
		t.OutboxTopic, limit)
	if err != nil {
		return 0, 0, false, fmt.Errorf("move due messages into %s: %w", t.OutboxTable(), err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, 0, false, err
	}
	if err := tx.Commit(); err != nil {
		return 0, 0, false, fmt.Errorf("commit moving due messages: %w", err)
	}
	var secs sql.NullFloat64
	if err := db.QueryRowContext(ctx, `SELECT EXTRACT(EPOCH FROM min(due_at) - clock_timestamp())::float8 FROM `+
		t.ScheduledTable()+` WHERE outbox_topic = $1`, t.OutboxTopic).Scan(&secs); err != nil {
		return int(n), 0, false, fmt.Errorf("find the next due message in %s: %w", t.ScheduledTable(), err)
	}
	return int(n), time.Duration(secs.Float64 * float64(time.Second)), secs.Valid, nil
}

// ScheduledRow is one scheduled message as a listing shows it.
type ScheduledRow struct {
	ID, Topic, Type, AggregateType, AggregateID string
	DueAt, ScheduledAt                          time.Time
}

// ListScheduled returns up to limit scheduled messages (all of them when
// limit is negative), the soonest due first, and how many are scheduled in
// all.
func (t Tables) ListScheduled(ctx context.Context, db DBTX, limit int) ([]ScheduledRow, int64, error) {
	var total int64
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+t.ScheduledTable()+` WHERE outbox_topic = $1`, t.OutboxTopic).Scan(&total); err != nil {
		return nil, 0, fmt.Errorf("count %s: %w", t.ScheduledTable(), err)
	}
	out, err := t.scheduledRows(ctx, db, `WHERE outbox_topic = $1 ORDER BY due_at, seq LIMIT $2`,
		t.OutboxTopic, sql.NullInt64{Int64: int64(limit), Valid: limit >= 0})
	return out, total, err
}

// ScheduledByID returns the scheduled messages of ids that are still
// scheduled, the soonest due first; an id not scheduled (moved into the
// outbox, or cancelled) is left out.
func (t Tables) ScheduledByID(ctx context.Context, db DBTX, ids []string) ([]ScheduledRow, error) {
	return t.scheduledRows(ctx, db, `WHERE outbox_topic = $1 AND id = ANY($2) ORDER BY due_at, seq`, t.OutboxTopic, ids)
}

// scheduledRows reads the listing columns of the scheduled messages where
// (a WHERE clause and its order) selects.
func (t Tables) scheduledRows(ctx context.Context, db DBTX, where string, args ...any) ([]ScheduledRow, error) {
	rows, err := db.QueryContext(ctx, `SELECT id, destination_topic, event_type, aggregate_type, aggregate_id, due_at, scheduled_at
		FROM `+t.ScheduledTable()+` `+where, args...)
	return collect(rows, err, "list "+t.ScheduledTable(), func(rows *sql.Rows, r *ScheduledRow) error {
		return rows.Scan(&r.ID, &r.Topic, &r.Type, &r.AggregateType, &r.AggregateID, &r.DueAt, &r.ScheduledAt)
	})
}

// scheduledStatements are the scheduled table's DDL.
func (t Tables) scheduledStatements() []string {
	notifyFunc := t.qualify("millrace_notify_scheduled")
	payloadType := t.SchemaAdapter().PayloadColumnType(t.OutboxTopic)
	return []string{
		// payload and metadata have the outbox's column types, so that a
		// row moves into the outbox byte for byte.
		`CREATE TABLE IF NOT EXISTS ` + t.ScheduledTable() + ` (
	outbox_topic TEXT NOT NULL,
	id TEXT NOT NULL,
	seq BIGSERIAL NOT NULL,
	due_at TIMESTAMPTZ NOT NULL,
	destination_topic TEXT NOT NULL,
	event_type TEXT NOT NULL,
	aggregate_type TEXT NOT NULL,
	aggregate_id TEXT NOT NULL,
	outbox_uuid VARCHAR(36) NOT NULL,
	payload ` + payloadType + ` NOT NULL,
	metadata JSON NOT NULL,
	scheduled_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	PRIMARY KEY (outbox_topic, id)
)`,
		t.index("millrace_scheduled_due", t.ScheduledTable(), `(outbox_topic, due_at, seq)`),
		`CREATE OR REPLACE FUNCTION ` + notifyFunc + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_notify('` + ScheduledNotifyChannel + `', TG_TABLE_SCHEMA);
	RETURN NULL;
END $$`,
		trigger("millrace_notify_scheduled", "AFTER INSERT", t.ScheduledTable(), "STATEMENT", notifyFunc),
	}
}
