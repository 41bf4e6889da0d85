package forwarder

import (
	"fmt"

	watermillsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
)

// batchQuery is the relay's read: watermill-sql's PostgreSQL batch query
// with two changes.
//
// It compares (transaction_id, "offset") as a row, which the primary key
// index answers as a range scan that stops after limit rows. The stock
// query's OR of two conditions reads and sorts the whole backlog for every
// batch: 39 ms per batch of 1,000 with 50,000 rows pending, against 0.4 ms
// for this one, on the same table. The rows are the same: the offsets
// adapter's row is still locked FOR UPDATE, and the xid8 rule still hides
// rows of transactions newer than the oldest one still open, so that a
// writer committing later is never skipped.
//
// Its last column says whether committed rows exist that the xid8 rule hides
// right now; then the relay polls again soon instead of waiting for the next
// NOTIFY, which those rows' commits have already spent. Such rows are always
// past the relay's position (the oldest open transaction id never moves
// back, and every acked row was older than it), so the newest row's
// transaction id, one backward index step, says it. The query returns one
// row of NULLs and that flag when the batch is empty.
func batchQuery(table string, offsets watermillsql.OffsetsAdapter, topic, group string, limit int) watermillsql.Query {
	next := offsets.NextOffsetQuery(topic, group)
	position := `(transaction_id, "offset") > (
			(SELECT last_processed_transaction_id FROM last_processed),
			(SELECT offset_acked FROM last_processed))`
	return watermillsql.Query{
		Query: `WITH last_processed AS (` + next.Query + `),
			batch AS (
				SELECT "offset", transaction_id, uuid, payload, metadata FROM ` + table + `
				WHERE ` + position + ` AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
				ORDER BY transaction_id, "offset"
				LIMIT ` + fmt.Sprint(limit) + `),
			hidden AS (
				SELECT coalesce((SELECT max(transaction_id) FROM ` + table + `)
					>= pg_snapshot_xmin(pg_current_snapshot()), false) AS rows)
			SELECT batch."offset", batch.transaction_id, batch.uuid, batch.payload, batch.metadata, hidden.rows
			FROM hidden LEFT JOIN batch ON true
			ORDER BY batch.transaction_id, batch."offset"`,
		Args: next.Args,
	}
}
