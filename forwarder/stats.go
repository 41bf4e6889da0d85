package forwarder

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/pgschema"
)

// statsEvery bounds how often a busy relay counts its backlog; an idle relay
// never does (an empty batch already says nothing is pending), which keeps
// it at one query per poll interval.
const statsEvery = 5 * time.Second

func (f *Forwarder) recordIdle() {
	f.metrics.pending.Set(0)
	f.metrics.oldestAge.Set(0)
}

func (f *Forwarder) recordBatch(ctx context.Context, handled []outboxRow, read int) {
	now := time.Now()
	f.metrics.batches.Inc()
	forwarded := 0
	for _, r := range handled {
		if r.quarantine != "" {
			continue
		}
		forwarded++
		if !r.occurred.IsZero() {
			f.metrics.commitToPublish.Observe(now.Sub(r.occurred).Seconds())
		}
	}
	f.metrics.forwarded.Add(float64(forwarded))
	if read < f.cfg.BatchSize && len(handled) == read {
		f.recordIdle()
		return
	}
	if now.Sub(f.lastStats) < statsEvery {
		return
	}
	f.lastStats = now
	pending, oldest, err := f.Pending(ctx)
	if err != nil {
		f.logger.Error("Could not measure the outbox backlog", err, nil)
		return
	}
	f.metrics.pending.Set(float64(pending))
	f.metrics.oldestAge.Set(oldest.Seconds())
}

// Pending counts the committed outbox rows this relay's group has not
// forwarded yet and the age of the oldest of them.
func (f *Forwarder) Pending(ctx context.Context) (rows int64, oldest time.Duration, err error) {
	st, err := inspect(ctx, f.db, f.tables, f.cfg.ConsumerGroup)
	return st.Pending, st.OldestPendingAge, err
}

// Status is the state of an outbox as seen by one relay consumer group.
type Status struct {
	// Pending counts committed rows not forwarded yet.
	Pending int64 `json:"pending"`
	// OldestPendingAge is the age of the oldest pending row.
	OldestPendingAge time.Duration `json:"oldest_pending_age_ns"`
	// LastForwardedAt is when the last forwarded row was written, if it is
	// still in the table; zero otherwise.
	LastForwardedAt time.Time `json:"last_forwarded_at,omitzero"`
	// Forwarded counts forwarded rows still in the table (kept for retention).
	Forwarded int64 `json:"forwarded_retained"`
	// Quarantined counts rows in the relay quarantine table.
	Quarantined int64 `json:"quarantined"`
}

// Inspect reads the status of outbox for the relay consumer group group
// ("" means the default, millrace_relay).
func Inspect(ctx context.Context, db *sql.DB, outbox Outbox, group string) (Status, error) {
	tables := pgschema.Tables{Schema: outbox.Schema, OutboxTopic: outbox.Topic}
	if err := tables.Validate(); err != nil {
		return Status{}, fmt.Errorf("inspect outbox: %w", err)
	}
	group = cmp.Or(group, Config{}.WithDefaults().ConsumerGroup)
	if err := names.Topic(group); err != nil {
		return Status{}, fmt.Errorf("inspect outbox: relay consumer group %q: %w", group, err)
	}
	return inspect(ctx, db, tables, group)
}

func inspect(ctx context.Context, db *sql.DB, t pgschema.Tables, group string) (Status, error) {
	var st Status
	var age sql.NullFloat64
	var last sql.NullTime
	err := db.QueryRowContext(ctx, `
		WITH o AS (SELECT offset_acked, last_processed_transaction_id AS txid FROM `+t.Offsets()+` WHERE consumer_group = $1),
		m AS (
			SELECT created_at,
				EXISTS (SELECT 1 FROM o WHERE m.transaction_id < o.txid OR (m.transaction_id = o.txid AND m."offset" <= o.offset_acked)) AS done,
				EXISTS (SELECT 1 FROM o WHERE m.transaction_id = o.txid AND m."offset" = o.offset_acked) AS last
			FROM `+t.Outbox()+` m)
		SELECT count(*) FILTER (WHERE NOT done),
			EXTRACT(EPOCH FROM LOCALTIMESTAMP - min(created_at) FILTER (WHERE NOT done))::float8,
			count(*) FILTER (WHERE done),
			(max(created_at) FILTER (WHERE last)) AT TIME ZONE current_setting('TimeZone'),
			(SELECT count(*) FROM `+t.RelayQuarantine()+`)
		FROM m`, group).Scan(&st.Pending, &age, &st.Forwarded, &last, &st.Quarantined)
	if err != nil {
		return Status{}, fmt.Errorf("inspect outbox %s: %w", t.Outbox(), err)
	}
	st.OldestPendingAge = time.Duration(age.Float64 * float64(time.Second))
	st.LastForwardedAt = last.Time
	return st, nil
}

// cleanup deletes forwarded rows older than the retention in bounded
// batches, so no DELETE holds a long transaction or bloats the WAL at once.
func (f *Forwarder) cleanup(ctx context.Context) {
	total := int64(0)
	for ctx.Err() == nil {
		n, err := f.DeleteForwarded(ctx, *f.cfg.Retention, f.cfg.CleanupBatch)
		if err != nil {
			f.logger.Error("Outbox cleanup failed", err, nil)
			return
		}
		total += n
		f.metrics.deleted.Add(float64(n))
		if n < int64(f.cfg.CleanupBatch) {
			break
		}
	}
	if total > 0 {
		f.logger.Debug("Outbox cleanup", map[string]any{"deleted": total})
	}
}

// DeleteForwarded deletes up to limit outbox rows that this relay's group
// has forwarded and that are older than olderThan, and returns how many.
func (f *Forwarder) DeleteForwarded(ctx context.Context, olderThan time.Duration, limit int) (int64, error) {
	res, err := f.db.ExecContext(ctx, `
		DELETE FROM `+f.tables.Outbox()+` WHERE ctid = ANY(ARRAY(
			SELECT m.ctid FROM `+f.tables.Outbox()+` m
			JOIN `+f.tables.Offsets()+` o ON o.consumer_group = $1
			WHERE (m.transaction_id < o.last_processed_transaction_id
			    OR (m.transaction_id = o.last_processed_transaction_id AND m."offset" <= o.offset_acked))
			  AND m.created_at < LOCALTIMESTAMP - make_interval(secs => $2)
			ORDER BY m.transaction_id, m."offset"
			LIMIT $3))`,
		f.cfg.ConsumerGroup, olderThan.Seconds(), limit)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}
