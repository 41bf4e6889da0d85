package store

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// Quarantine moves the outbox row r aside, in the relay's batch transaction
// tx, with the reason no broker can take it; topic and eventID are empty
// when its envelope is unreadable.
func (t Tables) Quarantine(ctx context.Context, tx DBTX, r OutboxRow, topic, eventID, reason string) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO `+t.QuarantineTable()+
		` (outbox_offset, outbox_uuid, destination_topic, event_id, payload, metadata, reason) VALUES ($1, $2, $3, $4, $5, $6, $7)`,
		r.Offset, string(r.UUID), nullable(topic), nullable(eventID), r.Payload, string(r.Metadata), clean(reason))
	if err != nil {
		return fmt.Errorf("quarantine outbox row %d: %w", r.Offset, err)
	}
	return nil
}

func nullable(s string) sql.NullString { return sql.NullString{String: s, Valid: s != ""} }

// QuarantineQuery says which quarantine rows to read and how.
// Read.NewestFirst orders by quarantined_at; Read.Full also reads the
// payload (the outbox row's envelope) and metadata.
type QuarantineQuery struct {
	Filter RowFilter
	Read
}

// QuarantineRow is one row of the relay quarantine.
type QuarantineRow struct {
	ID            int64
	OutboxOffset  int64
	OutboxUUID    string
	Topic         string // "" when the envelope was unreadable
	EventID       string // "" when the envelope was unreadable
	Reason        string
	QuarantinedAt time.Time
	ReplayedAt    *time.Time
	TimesReplayed int
	PayloadBytes  int

	// With QuarantineQuery.Full only.
	Payload  []byte
	Metadata string
}

// Quarantined reads the rows q selects.
func (t Tables) Quarantined(ctx context.Context, db DBTX, q QuarantineQuery) ([]QuarantineRow, error) {
	cols := `q.id, q.outbox_offset, q.outbox_uuid, coalesce(q.destination_topic, ''), coalesce(q.event_id, ''), q.reason,
	q.quarantined_at, q.replayed_at, q.times_replayed, length(q.payload)`
	if q.Full {
		cols += `, q.payload, coalesce(q.metadata, '')`
	}
	var args []any
	var b strings.Builder
	b.WriteString(`SELECT ` + cols + ` FROM ` + t.QuarantineTable() + ` q`)
	q.finish(&b, q.Filter.conditions(&args, "q", "destination_topic", "quarantined_at").list, "q", "q.quarantined_at DESC, q.id DESC")
	rows, err := db.QueryContext(ctx, b.String(), args...)
	return collect(rows, err, "read "+t.QuarantineTable(), func(rows *sql.Rows, r *QuarantineRow) error {
		var replayed sql.NullTime
		dest := []any{&r.ID, &r.OutboxOffset, &r.OutboxUUID, &r.Topic, &r.EventID, &r.Reason,
			&r.QuarantinedAt, &replayed, &r.TimesReplayed, &r.PayloadBytes}
		if q.Full {
			dest = append(dest, &r.Payload, &r.Metadata)
		}
		err := rows.Scan(dest...)
		r.QuarantinedAt, r.ReplayedAt = r.QuarantinedAt.UTC(), utcPtr(replayed)
		return err
	})
}

// MarkQuarantineReplayed sets replayed_at and counts a replay of the
// quarantine rows ids, in tx.
func (t Tables) MarkQuarantineReplayed(ctx context.Context, tx DBTX, ids []int64) error {
	if _, err := tx.ExecContext(ctx, `UPDATE `+t.QuarantineTable()+
		` SET replayed_at = now(), times_replayed = times_replayed + 1 WHERE id = ANY($1)`, ids); err != nil {
		return fmt.Errorf("mark replayed: %w", err)
	}
	return nil
}

// DeleteQuarantined deletes the quarantine rows ids.
func (t Tables) DeleteQuarantined(ctx context.Context, db DBTX, ids []int64) error {
	if _, err := db.ExecContext(ctx, `DELETE FROM `+t.QuarantineTable()+` WHERE id = ANY($1)`, ids); err != nil {
		return fmt.Errorf("delete from %s: %w", t.QuarantineTable(), err)
	}
	return nil
}
