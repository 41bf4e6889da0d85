package bus_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// Saga steps under group commit (consumer.batch.max_messages 8), on two
// consumers of one group: the events of several sagas share an inbox batch,
// each in its own savepoint, and the adds of one counter race each other,
// so steps meet version conflicts and run again in their own savepoint
// inside the message's. A step that fails once rolls back alone. Each
// command is sent once per step, no add is lost, and the closing
// compensation is sent once per saga.
func TestSagaStepsInInboxBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newChainWorld(t, func(c *bus.Config) {
		brokertest.Apply(t, bus.KindNATS, c)
		c.Relay.PollInterval = 20 * time.Millisecond
		c.Consumer.Workers = 8
		c.Consumer.Batch.MaxMessages = 8
		c.Consumer.Batch.MaxWait = 100 * time.Millisecond
	})
	suffix := "-" + testdb.UniqueName("")[3:]
	topic, commands, group := "counters"+suffix, "counter-commands"+suffix, "counter-saga"+suffix
	brokertest.Cleanup(t, bus.KindNATS, topic, group)
	opened := bus.Must(bus.NewTopic[counterOpened](topic))
	added := bus.Must(bus.NewTopic[counterAdded](topic))
	const counters, adds, total = 12, 5, 15 // each counter gets 1+2+...+5

	var steps, failed atomic.Int32
	saga := func(b *bus.Bus) *bus.Saga[counterState] {
		s := bus.NewSaga[counterState]("counter")
		send := func(ctx context.Context, id, typ string) error {
			return b.Publish(ctx, bus.Tx[bus.Execer](ctx), commands, bus.Event{Type: typ, AggregateType: "counter", AggregateID: id, Payload: []byte(`{}`)})
		}
		bus.StartWith(s, opened, func(m bus.Message[counterOpened]) string { return m.Value.ID },
			func(ctx context.Context, sc *bus.SagaContext[counterState], m bus.Message[counterOpened]) error {
				return send(ctx, sc.ID, "Opened")
			})
		bus.Then(s, added, func(m bus.Message[counterAdded]) string { return m.Value.ID },
			func(ctx context.Context, sc *bus.SagaContext[counterState], m bus.Message[counterAdded]) error {
				steps.Add(1)
				if err := send(ctx, sc.ID, fmt.Sprintf("Add%d", m.Value.N)); err != nil {
					return err
				}
				if sc.ID == "c-3" && m.Value.N == 3 && failed.CompareAndSwap(0, 1) {
					return errors.New("the ledger is unavailable") // after a write: the savepoint undoes it
				}
				sc.State.Sum += m.Value.N
				if sc.State.Sum == total {
					sc.Complete()
					return send(ctx, sc.ID, "Close") // the compensation, once
				}
				return nil
			})
		return s
	}
	reg2 := prometheus.NewRegistry()
	second, err := bus.Open(ctx, w.tb.cfg, w.tb.db, bus.WithRegistry(reg2))
	require.NoError(t, err)
	t.Cleanup(func() { second.Close() })
	for _, b := range []*bus.Bus{w.tb.bus, second} {
		require.NoError(t, saga(b).Handle(b, group))
		runCtx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- b.Run(runCtx) }()
		t.Cleanup(func() { stop(); require.NoError(t, <-done) })
	}

	var opens []counterOpened
	for i := range counters {
		opens = append(opens, counterOpened{ID: fmt.Sprintf("c-%d", i)})
	}
	publish(t, w, func(tx *sql.Tx) error { return opened.Publish(ctx, w.tb.bus, tx, opens...) })
	testkit.Eventually(t, time.Minute, "every counter opened", func() bool {
		list, err := w.ops.ListSagas(ctx, ops.SagaFilter{Saga: "counter"}, 0)
		require.NoError(t, err)
		return len(list.Instances) == counters
	})
	// The adds of every counter in one transaction, interleaved, so that
	// batches hold several counters' adds and both consumers hold some of
	// one counter's.
	var all []counterAdded
	for n := 1; n <= adds; n++ {
		for i := range counters {
			all = append(all, counterAdded{ID: fmt.Sprintf("c-%d", i), N: n})
		}
	}
	publish(t, w, func(tx *sql.Tx) error { return added.Publish(ctx, w.tb.bus, tx, all...) })
	testkit.Eventually(t, 2*time.Minute, "every counter closed", func() bool {
		list, err := w.ops.ListSagas(ctx, ops.SagaFilter{Saga: "counter", Completed: true}, 0)
		require.NoError(t, err)
		closed := 0
		for _, inst := range list.Instances {
			if inst.CompletedAt != nil {
				closed++
			}
		}
		return closed == counters
	})

	sent := map[string]int{}
	for _, r := range w.tb.outbox(t) {
		if r.topic == commands {
			sent[r.event.AggregateID+" "+r.event.Type]++
		}
	}
	want := map[string]int{}
	for i := range counters {
		id := fmt.Sprintf("c-%d", i)
		for _, typ := range []string{"Opened", "Add1", "Add2", "Add3", "Add4", "Add5", "Close"} {
			want[id+" "+typ] = 1
		}
	}
	require.Equal(t, want, sent, "each command once per step; the failed step's command rolled back")
	for i := range counters {
		row := sagaWorld{chainWorld: w}.instance(t, "counter", fmt.Sprintf("c-%d", i))
		require.JSONEq(t, fmt.Sprintf(`{"Sum":%d}`, total), string(row.State), "no lost update in %s", row.ID)
		require.Equal(t, int64(1+adds), row.Version, "each step applied once in %s", row.ID)
	}
	require.Equal(t, int32(1), failed.Load(), "the failing step ran")
	require.Greater(t, batchedMessages(t, w.reg)+batchedMessages(t, reg2), 0.0, "some inbox batches held more than one message")
	t.Logf("%d add steps ran for %d adds (the rest reran after a version conflict or the failure)", steps.Load(), counters*adds)
}

// batchedMessages is how many messages reg's inbox batches held beyond
// one per batch.
func batchedMessages(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	extra := 0.0
	for _, f := range families {
		if f.GetName() == middleware.MetricBatchSize {
			for _, m := range f.GetMetric() {
				extra += m.GetHistogram().GetSampleSum() - float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return extra
}

// publish commits what fn publishes in one transaction.
func publish(t *testing.T, w chainWorld, fn func(*sql.Tx) error) {
	t.Helper()
	tx, err := w.tb.db.Begin()
	require.NoError(t, err)
	require.NoError(t, fn(tx))
	require.NoError(t, tx.Commit())
}
