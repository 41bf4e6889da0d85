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
	r := newCounterRig(t)
	r.runTwoConsumers()
	r.openCounters()
	r.addToEveryCounter()
	r.checkCommandsAndState()
	require.Equal(t, int32(1), r.failed.Load(), "the failing step ran")
	require.Greater(t, batchedMessages(t, r.w.reg)+batchedMessages(t, r.reg2), 0.0, "some inbox batches held more than one message")
	t.Logf("%d add steps ran for %d adds (the rest reran after a version conflict or the failure)", r.steps.Load(), counterCount*counterAdds)
}

// Counters of the batch test, adds to each, and the sum each reaches
// (1+2+...+5).
const counterCount, counterAdds, counterTotal = 12, 5, 15

// counterRig is the counter saga on a NATS chain world that reads in
// batches of 8.
type counterRig struct {
	t               *testing.T
	w               chainWorld
	reg2            *prometheus.Registry // the second consumer's
	topic, commands string
	group           string
	opened          *bus.Topic[counterOpened]
	added           *bus.Topic[counterAdded]
	steps, failed   atomic.Int32
}

func newCounterRig(t *testing.T) *counterRig {
	w := newChainWorld(t, func(c *bus.Config) {
		brokertest.Apply(t, bus.KindNATS, c)
		c.Relay.PollInterval = 20 * time.Millisecond
		c.Consumer.Workers = 8
		c.Consumer.Batch.MaxMessages = 8
		c.Consumer.Batch.MaxWait = 100 * time.Millisecond
	})
	suffix := "-" + testdb.UniqueName("")[3:]
	r := &counterRig{t: t, w: w, reg2: prometheus.NewRegistry(),
		topic: "counters" + suffix, commands: "counter-commands" + suffix, group: "counter-saga" + suffix}
	brokertest.Cleanup(t, bus.KindNATS, r.topic, r.group)
	r.opened = bus.Must(bus.NewTopic[counterOpened](r.topic))
	r.added = bus.Must(bus.NewTopic[counterAdded](r.topic))
	return r
}

// saga is the counter saga on b: each step sends its command; the third
// add of c-3 fails once after its write; the sum reaching counterTotal
// completes the saga and sends Close, the compensation, once.
func (r *counterRig) saga(b *bus.Bus) *bus.Saga[counterState] {
	s := bus.NewSaga[counterState]("counter")
	send := func(ctx context.Context, id, typ string) error {
		return b.Publish(ctx, bus.Tx[bus.Execer](ctx), r.commands, bus.Event{Type: typ, AggregateType: "counter", AggregateID: id, Payload: []byte(`{}`)})
	}
	bus.StartWith(s, r.opened, func(m bus.Message[counterOpened]) string { return m.Value.ID },
		func(ctx context.Context, sc *bus.SagaContext[counterState], m bus.Message[counterOpened]) error {
			return send(ctx, sc.ID, "Opened")
		})
	bus.Then(s, r.added, func(m bus.Message[counterAdded]) string { return m.Value.ID },
		func(ctx context.Context, sc *bus.SagaContext[counterState], m bus.Message[counterAdded]) error {
			r.steps.Add(1)
			if err := send(ctx, sc.ID, fmt.Sprintf("Add%d", m.Value.N)); err != nil {
				return err
			}
			if sc.ID == "c-3" && m.Value.N == 3 && r.failed.CompareAndSwap(0, 1) {
				return errors.New("the ledger is unavailable") // after a write: the savepoint undoes it
			}
			sc.State.Sum += m.Value.N
			if sc.State.Sum == counterTotal {
				sc.Complete()
				return send(ctx, sc.ID, "Close") // the compensation, once
			}
			return nil
		})
	return s
}

// runTwoConsumers runs the saga on the world's Bus and on a second one
// of the same group.
func (r *counterRig) runTwoConsumers() {
	t := r.t
	second, err := bus.Open(context.Background(), r.w.tb.cfg, r.w.tb.db, bus.WithRegistry(r.reg2))
	require.NoError(t, err)
	t.Cleanup(func() { second.Close() })
	for _, b := range []*bus.Bus{r.w.tb.bus, second} {
		require.NoError(t, r.saga(b).Handle(b, r.group))
		running := testkit.Start(t, b.Run)
		t.Cleanup(func() { require.NoError(t, running.Stop(t, time.Minute)) })
	}
}

// openCounters opens every counter and waits for their sagas.
func (r *counterRig) openCounters() {
	ctx := context.Background()
	var opens []counterOpened
	for i := range counterCount {
		opens = append(opens, counterOpened{ID: fmt.Sprintf("c-%d", i)})
	}
	publish(r.t, r.w, func(tx *sql.Tx) error { return r.opened.Publish(ctx, r.w.tb.bus, tx, opens...) })
	testkit.Eventually(r.t, time.Minute, "every counter opened", func() bool {
		list, err := r.w.ops.ListSagas(ctx, ops.SagaFilter{Saga: "counter"}, 0)
		require.NoError(r.t, err)
		return len(list.Instances) == counterCount
	})
}

// addToEveryCounter publishes the adds of every counter in one
// transaction, interleaved, so that batches hold several counters' adds
// and both consumers hold some of one counter's; it waits until every
// counter closed.
func (r *counterRig) addToEveryCounter() {
	ctx := context.Background()
	var all []counterAdded
	for n := 1; n <= counterAdds; n++ {
		for i := range counterCount {
			all = append(all, counterAdded{ID: fmt.Sprintf("c-%d", i), N: n})
		}
	}
	publish(r.t, r.w, func(tx *sql.Tx) error { return r.added.Publish(ctx, r.w.tb.bus, tx, all...) })
	testkit.Eventually(r.t, 2*time.Minute, "every counter closed", func() bool {
		list, err := r.w.ops.ListSagas(ctx, ops.SagaFilter{Saga: "counter", Completed: true}, 0)
		require.NoError(r.t, err)
		closed := 0
		for _, inst := range list.Instances {
			if inst.CompletedAt != nil {
				closed++
			}
		}
		return closed == counterCount
	})
}

// checkCommandsAndState: each command once per step, the failed step's
// rolled back, and each counter's sum and version exact.
func (r *counterRig) checkCommandsAndState() {
	t := r.t
	sent := map[string]int{}
	for _, row := range r.w.tb.outbox(t) {
		if row.topic == r.commands {
			sent[row.event.AggregateID+" "+row.event.Type]++
		}
	}
	want := map[string]int{}
	for i := range counterCount {
		id := fmt.Sprintf("c-%d", i)
		for _, typ := range []string{"Opened", "Add1", "Add2", "Add3", "Add4", "Add5", "Close"} {
			want[id+" "+typ] = 1
		}
	}
	require.Equal(t, want, sent, "each command once per step; the failed step's command rolled back")
	for i := range counterCount {
		row := sagaWorld{chainWorld: r.w}.instance(t, "counter", fmt.Sprintf("c-%d", i))
		require.JSONEq(t, fmt.Sprintf(`{"Sum":%d}`, counterTotal), string(row.State), "no lost update in %s", row.ID)
		require.Equal(t, int64(1+counterAdds), row.Version, "each step applied once in %s", row.ID)
	}
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
