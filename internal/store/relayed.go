package store

import (
	"context"
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
	defer rows.Close()
	present := make(map[int64]bool, len(offsets))
	for rows.Next() {
		var offset int64
		if err := rows.Scan(&offset); err != nil {
			return nil, fmt.Errorf("delete relayed rows from %s: %w", t.OutboxTable(), err)
		}
		present[offset] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("delete relayed rows from %s: %w", t.OutboxTable(), err)
	}
	return present, nil
}
