package store

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// PerMinute counts rows per group and minute, over whole minutes on the
// database's clock that end with the current one.
type PerMinute struct {
	// Start is the start of the first minute.
	Start time.Time
	// Counts holds, per group, one count per minute from Start on, oldest
	// first; the last is the current minute, still under way.
	Counts map[string][]int64
}

// window is a WITH clause ($1 the number of minutes) whose one row w is the
// start of the first minute, as a TIMESTAMP (start, on the clock of the
// outbox's created_at) and as a TIMESTAMPTZ (start_tz). Both come from the
// transaction's start time, so that every statement of one transaction
// counts over the same minutes.
const window = `
		WITH w AS (
			SELECT s AS start, s AT TIME ZONE current_setting('TimeZone') AS start_tz
			FROM (SELECT date_trunc('minute', LOCALTIMESTAMP) - make_interval(mins => $1::int - 1) AS s) x)`

// ForwardedPerMinute counts, for each relay group of groups on an outbox of
// shards shards, the outbox rows written in each of the last minutes
// minutes (by created_at) that the group has forwarded by now. The database
// records no time of forwarding: a row counts in the minute it was written,
// once its group has forwarded it. Rows the relay's cleanup deleted
// (forwarded and older than relay.retention) are not counted, nor are rows
// not forwarded yet. It reads every outbox row of the window, as Status
// reads the whole outbox.
func (t Tables) ForwardedPerMinute(ctx context.Context, db DBTX, groups []string, shards, minutes int) (PerMinute, error) {
	quoted := make([]string, len(groups))
	for i, g := range groups {
		quoted[i] = quoteArrayElement(g)
	}
	// A sharded outbox has one cursor per shard, and rows of a shard beyond
	// the count (written before it was lowered) were all forwarded.
	rows, err := db.QueryContext(ctx, window+`,
		per AS (
			SELECT g.name AS grp, floor(EXTRACT(EPOCH FROM m.created_at - w.start) / 60)::int AS i, count(*) AS n
			FROM w CROSS JOIN unnest($2::text::text[]) AS g(name)
			JOIN `+t.OutboxTable()+` m ON m.created_at >= w.start
			LEFT JOIN `+t.CursorsTable()+` c ON c.outbox_topic = $3 AND c.consumer_group =
				CASE WHEN $4::int <= 1 THEN g.name ELSE g.name || '#' || m.shard || '/' || $4::int END
			WHERE ($4::int > 1 AND m.shard >= $4::int) OR coalesce(`+forwarded+`, false)
			GROUP BY g.name, i)
		SELECT w.start_tz, per.grp, per.i, per.n FROM w LEFT JOIN per ON true`,
		minutes, "{"+strings.Join(quoted, ",")+"}", t.OutboxTopic, shards)
	if err != nil {
		return PerMinute{}, fmt.Errorf("count the forwarded rows of %s per minute: %w", t.OutboxTable(), err)
	}
	pm, err := scanPerMinute(rows, minutes)
	if err != nil {
		return PerMinute{}, fmt.Errorf("count the forwarded rows of %s per minute: %w", t.OutboxTable(), err)
	}
	for _, g := range groups {
		if pm.Counts[g] == nil {
			pm.Counts[g] = make([]int64, minutes)
		}
	}
	return pm, nil
}

// ProcessedPerMinute counts, for each consumer group with inbox rows in the
// last minutes minutes, the inbox rows of each minute (by processed_at, the
// start of the transaction that processed the event): the events its
// handlers processed through the inbox, not their duplicates, nor events
// of handlers without an inbox, nor rows pruned since
// (consumer.inbox.retention).
func (t Tables) ProcessedPerMinute(ctx context.Context, db DBTX, minutes int) (PerMinute, error) {
	rows, err := db.QueryContext(ctx, window+`,
		per AS (
			SELECT i.consumer_group AS grp, floor(EXTRACT(EPOCH FROM i.processed_at - w.start_tz) / 60)::int AS i, count(*) AS n
			FROM w JOIN `+t.InboxTable()+` i ON i.processed_at >= w.start_tz
			GROUP BY i.consumer_group, 2)
		SELECT w.start_tz, per.grp, per.i, per.n FROM w LEFT JOIN per ON true`, minutes)
	if err != nil {
		return PerMinute{}, fmt.Errorf("count the inbox rows per minute: %w", err)
	}
	pm, err := scanPerMinute(rows, minutes)
	if err != nil {
		return PerMinute{}, fmt.Errorf("count the inbox rows per minute: %w", err)
	}
	return pm, nil
}

// scanPerMinute reads rows of (start, group, minute, count), the group
// NULL in the one row of a window without any, into a PerMinute of minutes
// minutes. It leaves out minutes past the window: rows of transactions that
// began after the reading one.
func scanPerMinute(rows *sql.Rows, minutes int) (PerMinute, error) {
	defer rows.Close()
	pm := PerMinute{Counts: map[string][]int64{}}
	for rows.Next() {
		var group sql.NullString
		var i, n sql.NullInt64
		if err := rows.Scan(&pm.Start, &group, &i, &n); err != nil {
			return PerMinute{}, err
		}
		if !group.Valid || i.Int64 < 0 || i.Int64 >= int64(minutes) {
			continue
		}
		if pm.Counts[group.String] == nil {
			pm.Counts[group.String] = make([]int64, minutes)
		}
		pm.Counts[group.String][i.Int64] = n.Int64
	}
	return pm, rows.Err()
}
