package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// MarkProcessed inserts (group, eventID) into the inbox in the handler's
// transaction tx and reports whether it was new: false means the event was
// processed before (a duplicate). A concurrent duplicate waits on the row
// lock and then sees the row.
func (t Tables) MarkProcessed(ctx context.Context, tx Execer, group, eventID string) (bool, error) {
	res, err := tx.ExecContext(ctx, `INSERT INTO `+t.InboxTable()+` (consumer_group, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`,
		group, eventID)
	if err != nil {
		return false, fmt.Errorf("inbox: insert event id: %w", err)
	}
	n, err := res.RowsAffected()
	return n > 0, err
}

// MarkProcessedAll inserts the inbox rows of eventIDs for group in tx in one
// statement, skipping those that exist; it returns how many it added.
func (t Tables) MarkProcessedAll(ctx context.Context, tx Execer, group string, eventIDs []string) (int64, error) {
	res, err := tx.ExecContext(ctx, `INSERT INTO `+t.InboxTable()+` (consumer_group, event_id) SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING`,
		group, eventIDs)
	if err != nil {
		return 0, fmt.Errorf("inbox: insert event ids: %w", err)
	}
	return res.RowsAffected()
}

// UnmarkProcessed deletes the inbox rows of eventIDs for group in tx,
// inserted earlier in tx, so that those events can be processed again.
func (t Tables) UnmarkProcessed(ctx context.Context, tx Execer, group string, eventIDs ...string) error {
	if _, err := tx.ExecContext(ctx, `DELETE FROM `+t.InboxTable()+` WHERE consumer_group = $1 AND event_id = ANY($2)`, group, eventIDs); err != nil {
		return fmt.Errorf("inbox: delete event ids: %w", err)
	}
	return nil
}

// ApplyVersion records version as the latest applied to the aggregate for
// group, in tx, unless an equal or newer one was applied already; it
// reports whether version was newer (false: the event is stale).
func (t Tables) ApplyVersion(ctx context.Context, tx Execer, group, aggregateType, aggregateID string, version int64, eventID string) (bool, error) {
	res, err := tx.ExecContext(ctx, `INSERT INTO `+t.AggregateVersionsTable()+` AS v (consumer_group, aggregate_type, aggregate_id, version, event_id)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (consumer_group, aggregate_type, aggregate_id) DO UPDATE
SET version = EXCLUDED.version, event_id = EXCLUDED.event_id, updated_at = now()
WHERE v.version < EXCLUDED.version`, group, aggregateType, aggregateID, version, eventID)
	if err != nil {
		return false, fmt.Errorf("ordering guard: record aggregate version: %w", err)
	}
	n, err := res.RowsAffected()
	return n > 0, err
}

// AppliedVersion is the latest version group applied to the aggregate, 0
// when it applied none.
func (t Tables) AppliedVersion(ctx context.Context, db DBTX, group, aggregateType, aggregateID string) (int64, error) {
	var v int64
	err := db.QueryRowContext(ctx, `SELECT version FROM `+t.AggregateVersionsTable()+`
WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3`, group, aggregateType, aggregateID).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", t.AggregateVersionsTable(), err)
	}
	return v, nil
}

// PruneInbox deletes inbox rows processed more than olderThan ago (of group
// only, unless group is ""), batch rows per statement, until none is left
// or ctx ends, and returns how many it deleted. Short statements keep locks
// short and leave the index healthy; rows of a concurrent prune are skipped,
// not waited for.
func (t Tables) PruneInbox(ctx context.Context, db DBTX, olderThan time.Duration, group string, batch int) (int64, error) {
	if olderThan <= 0 || batch <= 0 {
		return 0, fmt.Errorf("prune inbox: olderThan and batch must be positive; got %s and %d", olderThan, batch)
	}
	inbox := t.InboxTable()
	query := `DELETE FROM ` + inbox + ` WHERE (consumer_group, event_id) IN (
	SELECT consumer_group, event_id FROM ` + inbox + `
	WHERE processed_at < now() - make_interval(secs => $1) AND ($3 = '' OR consumer_group = $3)
	ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)`
	var total int64
	for {
		res, err := db.ExecContext(ctx, query, olderThan.Seconds(), batch, group)
		if err != nil {
			return total, fmt.Errorf("prune inbox %s: %w", inbox, err)
		}
		n, _ := res.RowsAffected()
		total += n
		if n < int64(batch) {
			return total, nil
		}
	}
}

// CountInboxOlder counts the inbox rows PruneInbox would delete.
func (t Tables) CountInboxOlder(ctx context.Context, db DBTX, olderThan time.Duration, group string) (int64, error) {
	var n int64
	err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+t.InboxTable()+`
WHERE processed_at < now() - make_interval(secs => $1) AND ($2 = '' OR consumer_group = $2)`,
		olderThan.Seconds(), group).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count inbox rows: %w", err)
	}
	return n, nil
}

// InboxRows counts the inbox rows of every consumer group.
func (t Tables) InboxRows(ctx context.Context, db DBTX) (map[string]int64, error) {
	rows, err := db.QueryContext(ctx, `SELECT consumer_group, count(*) FROM `+t.InboxTable()+` GROUP BY consumer_group`)
	return collectMap[string, int64](rows, err, "count inbox rows")
}

// The savepoint each message of a batched inbox transaction runs in. One
// name serves every message: a batch runs its messages one after another,
// each savepoint set on top of the previous one, and ROLLBACK TO undoes the
// latest. A savepoint is not released, which would cost a round trip and
// free nothing: every subtransaction that wrote counts against the 64 that
// PostgreSQL caches per transaction either way.
const batchSavepoint = "millrace_message"

// Savepoint sets the savepoint of the next message of a batched inbox
// transaction tx.
func Savepoint(ctx context.Context, tx Execer) error {
	if _, err := tx.ExecContext(ctx, `SAVEPOINT `+batchSavepoint); err != nil {
		return fmt.Errorf("inbox: savepoint: %w", err)
	}
	return nil
}

// RollbackToSavepoint undoes what the message since Savepoint did, its
// inbox row included, and leaves the rest of tx as it was.
func RollbackToSavepoint(ctx context.Context, tx Execer) error {
	if _, err := tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT `+batchSavepoint); err != nil {
		return fmt.Errorf("inbox: rollback to savepoint: %w", err)
	}
	return nil
}
