package store

import (
	"context"
	"database/sql"
	"fmt"
)

// DeleteRelayed deletes the outbox rows whose offsets are given (rows the
// WAL relay forwarded or is quarantining, in its ack transaction tx) and
// returns the offsets of those that were still there: a row delivered
// again after a restart is gone already, and is not quarantined twice.
func (t Tables) DeleteRelayed(ctx context.Context, tx DBTX, offsets []int64) (map[int64]bool, error) {
	rows, err := tx.QueryContext(ctx, t.relaySQL(`DELETE FROM `+t.OutboxTable()+
		` WHERE "offset" = ANY($1::bigint[]) RETURNING "offset"`), offsets)
	if err != nil {
		return nil, fmt.Errorf("delete relayed rows from %s: %w", t.OutboxTable(), err)
	}
	return scanOffsets(rows, len(offsets), t.OutboxTable())
}

// scanOffsets reads rows of one offset each into a set, and closes rows.
func scanOffsets(rows *sql.Rows, n int, table string) (map[int64]bool, error) {
	defer rows.Close()
	found := make(map[int64]bool, n)
	for rows.Next() {
		var offset int64
		if err := rows.Scan(&offset); err != nil {
			return nil, fmt.Errorf("read offsets of %s: %w", table, err)
		}
		found[offset] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read offsets of %s: %w", table, err)
	}
	return found, nil
}

// MaxOffset is the highest offset of the outbox's rows, 0 when it is empty.
func (t Tables) MaxOffset(ctx context.Context, db DBTX) (int64, error) {
	var n int64
	if err := db.QueryRowContext(ctx, t.relaySQL(`SELECT coalesce(max("offset"), 0) FROM `+t.OutboxTable())).Scan(&n); err != nil {
		return 0, fmt.Errorf("read the highest offset of %s: %w", t.OutboxTable(), err)
	}
	return n, nil
}

// PresentOffsets returns which of offsets are still rows of the outbox.
func (t Tables) PresentOffsets(ctx context.Context, db DBTX, offsets []int64) (map[int64]bool, error) {
	rows, err := db.QueryContext(ctx, t.relaySQL(`SELECT "offset" FROM `+t.OutboxTable()+` WHERE "offset" = ANY($1::bigint[])`), offsets)
	if err != nil {
		return nil, fmt.Errorf("look up rows of %s: %w", t.OutboxTable(), err)
	}
	return scanOffsets(rows, len(offsets), t.OutboxTable())
}
