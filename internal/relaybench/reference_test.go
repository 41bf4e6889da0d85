package relaybench_test

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
)

// Batching of the reference relay, the same as millrace's defaults.
const (
	referenceBatch = 2000
	referencePoll  = 5 * time.Millisecond // when the outbox is empty
)

// runReference is the ceiling the relays are measured against: the simplest
// loop that moves the same rows to the same broker, with the same payloads
// and headers. It selects a batch on one pgx connection, publishes it
// pipelined through the adapter's PublishBatch and deletes the published
// rows in one statement, keeping its position in memory: no offsets row, no
// transaction, no lock, no quarantine, no metrics, no tracing; only the xid8
// rule, without which it would skip rows committed late. It is
// benchmark code only, and it counts its statements itself.
func runReference(ctx context.Context, dbURL, schema, outboxTopic string, broker adapters.Broker, statements *atomic.Int64) error {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	table := store.Tables{Schema: schema, OutboxTopic: outboxTopic}.OutboxTable()
	// The position lives in memory; rows of transactions older than every
	// open one are final, so the range up to the last row read holds exactly
	// the rows read, and one range DELETE removes them.
	selectBatch := `SELECT transaction_id::text::bigint, "offset", payload FROM ` + table +
		` WHERE (transaction_id, "offset") > ($1::text::xid8, $2)
		  AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
		ORDER BY transaction_id, "offset" LIMIT ` + strconv.Itoa(referenceBatch)
	deleteBatch := `DELETE FROM ` + table + ` WHERE (transaction_id, "offset") > ($1::text::xid8, $2)
		AND (transaction_id, "offset") <= ($3::text::xid8, $4)`
	var posTx, posOffset int64
	provisioned := map[string]bool{}
	out := make([]adapters.Outgoing, 0, referenceBatch)
	for ctx.Err() == nil {
		out = out[:0]
		statements.Add(1)
		rows, err := conn.Query(ctx, selectBatch, strconv.FormatInt(posTx, 10), posOffset)
		if err != nil {
			return err
		}
		var txID, offset, lastTx, lastOffset int64
		var payload []byte
		_, err = pgx.ForEachRow(rows, []any{&txID, &offset, &payload}, func() error {
			topic, msg, err := envelope.Unwrap(payload)
			if err != nil {
				return fmt.Errorf("row %d: %w", offset, err)
			}
			lastTx, lastOffset = txID, offset
			out = append(out, adapters.Outgoing{Topic: topic, Msg: msg})
			return nil
		})
		if err != nil {
			return err
		}
		if len(out) == 0 {
			time.Sleep(referencePoll)
			continue
		}
		for _, o := range out {
			if !provisioned[o.Topic] {
				if err := broker.Provision(ctx, o.Topic); err != nil {
					return err
				}
				provisioned[o.Topic] = true
			}
		}
		if err := broker.PublishBatch(ctx, out); err != nil {
			return err
		}
		statements.Add(1)
		if _, err := conn.Exec(ctx, deleteBatch, strconv.FormatInt(posTx, 10), posOffset, strconv.FormatInt(lastTx, 10), lastOffset); err != nil {
			return err
		}
		posTx, posOffset = lastTx, lastOffset
	}
	return nil
}
