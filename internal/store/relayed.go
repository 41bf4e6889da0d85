package store

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// DeleteRelayed deletes the outbox rows whose offsets are given (rows the
// WAL relay forwarded or is quarantining, in its ack transaction tx) and
// returns the offsets of those that were still there: a row delivered
// again after a restart is gone already, and is not quarantined twice.
func (t Tables) DeleteRelayed(ctx context.Context, tx DBTX, offsets []int64) (map[int64]bool, error) {
	rows, err := tx.QueryContext(ctx, t.relaySQL(`DELETE FROM `+t.OutboxTable()+
		` WHERE "offset" = ANY($1::bigint[]) RETURNING "offset"`), offsets)
	return collectSet(rows, err, "delete relayed rows from "+t.OutboxTable(), len(offsets))
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
	return collectSet(rows, err, "look up rows of "+t.OutboxTable(), len(offsets))
}

// visiblePoll bounds the pause between two checks of AwaitVisible.
const visiblePoll = 50 * time.Millisecond

// AwaitVisible waits until every transaction of xids (xid8, as the
// outbox's transaction_id) has ended for a new snapshot, checking at
// growing intervals up to visiblePoll, until ctx ends. A logical
// replication slot streams a transaction once its commit record is on
// disk, before the committing backend leaves the proc array: until then
// no statement sees its rows, and a DELETE of them deletes nothing (for
// long with synchronous replication, whose wait for the standby falls in
// between).
func (t Tables) AwaitVisible(ctx context.Context, db DBTX, xids []uint64) error {
	if len(xids) == 0 {
		return nil
	}
	list := make([]string, len(xids))
	for i, x := range xids {
		list[i] = strconv.FormatUint(x, 10)
	}
	array := "{" + strings.Join(list, ",") + "}"
	for wait := time.Millisecond; ; wait = min(2*wait, visiblePoll) {
		var visible bool
		err := db.QueryRowContext(ctx, t.relaySQL(`SELECT bool_and(pg_visible_in_snapshot(x, pg_current_snapshot()))
			FROM unnest($1::text::xid8[]) AS x`), array).Scan(&visible)
		if err != nil {
			return fmt.Errorf("wait for the commits of the rows of %s: %w", t.OutboxTable(), err)
		}
		if visible {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for the commits of the rows of %s: %w", t.OutboxTable(), context.Cause(ctx))
		case <-time.After(wait):
		}
	}
}
