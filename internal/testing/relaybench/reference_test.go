package relaybench_test

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/sync/errgroup"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
)

// Batching of the reference relay, the same as millrace's defaults.
const (
	referenceBatchSize = 2000
	referencePoll      = 5 * time.Millisecond // when the outbox is empty
)

// referenceBatch is one batch of the reference relay: the rows after from,
// up to and including to.
type referenceBatch struct {
	fromTx, fromOffset, toTx, toOffset int64
	out                                []adapters.Outgoing
}

// runReference is the ceiling the relays are measured against: the simplest
// loop that moves the same rows to the same broker, with the same payloads
// and headers, batched and pipelined. One goroutine selects batch after
// batch on its own pgx connection; the other publishes each batch pipelined
// through the adapter's PublishBatch and deletes it in one statement on a
// second connection, so the next select overlaps the publish. The position
// lives in memory: no offsets row, no transaction, no lock, no quarantine,
// no metrics, no tracing; only the xid8 rule, without which it would skip
// rows committed late (rows of transactions older than every open one are
// final, so the range up to the last row read holds exactly the rows read,
// and one range DELETE removes them). It is benchmark code only, and it
// counts its statements itself.
func runReference(ctx context.Context, dbURL, schema, outboxTopic string, broker adapters.Broker, statements *atomic.Int64) error {
	reader, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer reader.Close(context.Background())
	deleter, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer deleter.Close(context.Background())
	selectBatch, deleteBatch := referenceSQL(store.Tables{Schema: schema, OutboxTopic: outboxTopic}.OutboxTable())

	g, ctx := errgroup.WithContext(ctx)
	batches := make(chan referenceBatch, 1)
	g.Go(func() error {
		defer close(batches)
		var posTx, posOffset int64
		for ctx.Err() == nil {
			b := referenceBatch{fromTx: posTx, fromOffset: posOffset, out: make([]adapters.Outgoing, 0, referenceBatchSize)}
			statements.Add(1)
			rows, err := reader.Query(ctx, selectBatch, strconv.FormatInt(posTx, 10), posOffset)
			if err != nil {
				return err
			}
			var txID, offset int64
			var payload []byte
			_, err = pgx.ForEachRow(rows, []any{&txID, &offset, &payload}, func() error {
				topic, msg, err := envelope.Unwrap(payload)
				if err != nil {
					return fmt.Errorf("row %d: %w", offset, err)
				}
				b.toTx, b.toOffset = txID, offset
				b.out = append(b.out, adapters.Outgoing{Topic: topic, Msg: msg})
				return nil
			})
			if err != nil {
				return err
			}
			if len(b.out) == 0 {
				time.Sleep(referencePoll)
				continue
			}
			select {
			case batches <- b:
			case <-ctx.Done():
				return nil
			}
			posTx, posOffset = b.toTx, b.toOffset
		}
		return nil
	})
	g.Go(func() error {
		provisioned := map[string]bool{}
		for b := range batches {
			for _, o := range b.out {
				if !provisioned[o.Topic] {
					if err := broker.Provision(ctx, o.Topic); err != nil {
						return err
					}
					provisioned[o.Topic] = true
				}
			}
			if err := broker.PublishBatch(ctx, b.out); err != nil {
				return err
			}
			statements.Add(1)
			if _, err := deleter.Exec(ctx, deleteBatch, strconv.FormatInt(b.fromTx, 10), b.fromOffset,
				strconv.FormatInt(b.toTx, 10), b.toOffset); err != nil {
				return err
			}
		}
		return nil
	})
	return g.Wait()
}

// referenceSQL is the reference relay's two statements on the outbox table:
// the select of the batch after a position ($1, $2) by the xid8 rule, and
// the delete of the rows after a position up to another ($3, $4).
func referenceSQL(table string) (selectBatch, deleteBatch string) {
	selectBatch = `SELECT transaction_id::text::bigint, "offset", payload FROM ` + table +
		` WHERE (transaction_id, "offset") > ($1::text::xid8, $2)
		  AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
		ORDER BY transaction_id, "offset" LIMIT ` + strconv.Itoa(referenceBatchSize)
	deleteBatch = `DELETE FROM ` + table + ` WHERE (transaction_id, "offset") > ($1::text::xid8, $2)
		AND (transaction_id, "offset") <= ($3::text::xid8, $4)`
	return selectBatch, deleteBatch
}
