package bus_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// Batched inbox transactions on a pgx pool: four events share one pgx
// transaction, each in its savepoint; the one whose handler fails after its
// write is rolled back alone and poisoned, the other three commit once.
func TestPgxBatchedInboxTransaction(t *testing.T) {
	t.Parallel()
	pb := setupPgx(t, func(c *bus.Config) {
		c.Consumer.Workers = 5
		c.Consumer.Retry = middleware.RetryConfig{MaxAttempts: 2, InitialInterval: time.Minute, MaxInterval: time.Minute, MaxElapsed: time.Hour}
		c.Consumer.Batch = middleware.BatchConfig{MaxMessages: 4, MaxWait: 10 * time.Second}
	})
	ctx := context.Background()
	_, err := pb.db.Exec(`CREATE TABLE "` + pb.schema + `".invoices (order_id text PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)
	var mu sync.Mutex
	txOf := map[string]int64{}
	blocked := make(chan struct{})
	var blockedOnce sync.Once
	handle, err := pb.pgx.ConsumerChain(ctx, "orders.events", "billing", func(ctx context.Context, ev bus.Event) error {
		if ev.AggregateID == "o-blocker" {
			// It fails and waits a minute for its retry, in the chain: the
			// batch of the four others runs when full, not when it holds
			// every message in the chain.
			blockedOnce.Do(func() { close(blocked) })
			return errors.New("not now")
		}
		tx := bus.Tx[pgx.Tx](ctx)
		var txid int64
		if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&txid); err != nil {
			return err
		}
		mu.Lock()
		txOf[ev.ID] = txid
		mu.Unlock()
		if _, err := tx.Exec(ctx, `INSERT INTO "`+pb.schema+`".invoices VALUES ($1, $2)`, ev.AggregateID, ev.ID); err != nil {
			return err
		}
		if ev.AggregateID == "o-fail" {
			return bus.Permanent(errors.New("after the write: it must roll back"))
		}
		return nil
	}, nil)
	require.NoError(t, err)

	stop, cancel := context.WithCancel(ctx)
	blockerDone := make(chan error, 1)
	go func() { blockerDone <- handle(delivered(stop, "e-blocker", orderCreated("o-blocker"))) }()
	<-blocked
	var wg sync.WaitGroup
	for i, order := range []string{"o-1", "o-2", "o-fail", "o-3"} {
		wg.Go(func() {
			if err := handle(delivered(ctx, fmt.Sprintf("e-%d", i), orderCreated(order))); err != nil {
				t.Errorf("%s: %v", order, err)
			}
		})
	}
	wg.Wait()
	cancel()
	require.Error(t, <-blockerDone, "the blocker is returned for redelivery at the stop")

	require.Len(t, txOf, 4)
	for id, txid := range txOf {
		require.Equal(t, txOf["e-0"], txid, "%s ran in the batch's transaction", id)
	}
	var invoices int
	require.NoError(t, pb.db.QueryRow(`SELECT count(*) FROM "`+pb.schema+`".invoices`).Scan(&invoices))
	require.Equal(t, 3, invoices, "three effects; the failed handler's write rolled back with its savepoint")
	var inbox int
	require.NoError(t, pb.db.QueryRow(`SELECT count(*) FROM "`+pb.schema+`".millrace_inbox`).Scan(&inbox))
	require.Equal(t, 3, inbox)
	oc, err := ops.New(ctx, pb.db, pb.cfg)
	require.NoError(t, err)
	list, err := oc.DLQ().List(ctx, ops.Filter{Handler: "billing"}, 0)
	require.NoError(t, err)
	require.Len(t, list.Rows, 1)
	require.Equal(t, "e-2", list.Rows[0].EventID)
}
