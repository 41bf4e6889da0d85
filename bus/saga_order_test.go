package bus_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

type (
	raceOrderPlaced    struct{ OrderID string }
	raceOrderCancelled struct{ OrderID string }
	raceOrderState     struct{ Status string }
)

func (raceOrderPlaced) EventType() string                { return "OrderPlaced" }
func (e raceOrderPlaced) Aggregate() (string, string)    { return "order", e.OrderID }
func (raceOrderCancelled) EventType() string             { return "OrderCancelled" }
func (e raceOrderCancelled) Aggregate() (string, string) { return "order", e.OrderID }

// A saga's events of one instance are handled in order by default, on
// every broker: 15 orders placed and cancelled at once, each OrderPlaced
// step waiting (up to 10s) for its order's OrderCancelled to be handled
// first. With consumer.handlers.<saga>.ordered: false, as before, the
// cancellations overtake their OrderPlaced, find no saga and are ignored;
// by default none does, and every saga ends cancelled.
func TestSagaHandlesAnInstancesEventsInOrder(t *testing.T) {
	t.Parallel()
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			overtaken, cancelled := runCancelRace(t, kind, new(false))
			require.Positive(t, overtaken, "unordered, cancellations overtake their OrderPlaced")
			t.Logf("%s, ordered: false: %d of %d cancellations overtook their OrderPlaced", kind, overtaken, raceOrders)
			require.Equal(t, raceOrders-overtaken, cancelled)

			overtaken, cancelled = runCancelRace(t, kind, nil)
			require.Zero(t, overtaken, "by default no cancellation overtakes its OrderPlaced")
			require.Equal(t, raceOrders, cancelled, "every saga ends cancelled")
			t.Logf("%s, default: %d of %d cancellations overtook their OrderPlaced", kind, overtaken, raceOrders)
		})
	}
}

const raceOrders = 15

// runCancelRace runs the race on kind with the saga handler's ordered
// override and returns how many cancellations found no saga and how many
// sagas ended cancelled.
func runCancelRace(t *testing.T, kind string, ordered *bool) (overtaken, cancelled int) {
	ctx := context.Background()
	suffix := testdb.UniqueName("")[2:]
	name, topicName := "cancel-race-"+suffix, "orders-"+suffix
	tb := setup(t, func(c *bus.Config) {
		brokertest.Apply(t, kind, c)
		c.Relay.PollInterval = 50 * time.Millisecond
		c.Consumer.Workers = 16
		c.Consumer.Handlers = map[string]middleware.Config{name: {Ordered: ordered}}
	})
	brokertest.Cleanup(t, kind, topicName, name)
	placed := bus.Must(bus.NewTopic[raceOrderPlaced](topicName))
	cancel := bus.Must(bus.NewTopic[raceOrderCancelled](topicName))

	race := &cancelRace{handled: map[string]chan struct{}{}}
	reg := prometheus.NewRegistry()
	b, err := bus.Open(ctx, tb.cfg, tb.db, bus.WithRegistry(reg), bus.WithRouterMiddleware(race.watch))
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, race.saga(name, placed, cancel).Handle(b, name))
	running := testkit.Start(t, b.Run)
	defer func() { require.NoError(t, running.Stop(t, time.Minute)) }()

	for i := range raceOrders {
		id := fmt.Sprintf("o-%02d", i)
		tx, err := tb.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, placed.Publish(ctx, b, tx, raceOrderPlaced{OrderID: id}))
		require.NoError(t, cancel.Publish(ctx, b, tx, raceOrderCancelled{OrderID: id}))
		require.NoError(t, tx.Commit())
	}
	w := chainWorld{reg: reg}
	oc, err := ops.New(ctx, tb.db, tb.cfg)
	require.NoError(t, err)
	states := func() map[string]int {
		list, err := oc.ListSagas(ctx, ops.SagaFilter{Saga: name, Completed: true}, 0)
		require.NoError(t, err)
		out := map[string]int{}
		for _, inst := range list.Instances {
			var s raceOrderState
			require.NoError(t, json.Unmarshal(inst.State, &s))
			out[s.Status]++
		}
		return out
	}
	testkit.Eventually(t, 3*time.Minute, "every order placed and its cancellation handled", func() bool {
		unmatched := int(w.counter(t, bus.MetricSagaUnmatched, map[string]string{"saga": name, "event_type": "OrderCancelled"}))
		s := states()
		return s["placed"]+s["cancelled"] == raceOrders && s["cancelled"]+unmatched == raceOrders
	})
	return int(w.counter(t, bus.MetricSagaUnmatched, map[string]string{"saga": name, "event_type": "OrderCancelled"})), states()["cancelled"]
}

// cancelRace is the saga of the race, and the cancellations its handler
// went through.
type cancelRace struct {
	mu      sync.Mutex
	handled map[string]chan struct{} // closed once the order's OrderCancelled was handled
}

func (r *cancelRace) cancelled(id string) chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.handled[id] == nil {
		r.handled[id] = make(chan struct{})
	}
	return r.handled[id]
}

// watch is router middleware that notes each OrderCancelled handled.
func (r *cancelRace) watch(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if msg.Metadata.Get(bus.EventTypeKey) == "OrderCancelled" {
			close(r.cancelled(msg.Metadata.Get(bus.AggregateIDKey)))
		}
		return out, err
	}
}

// saga is the race's saga: OrderPlaced starts it, waiting (up to 10s) for
// the order's OrderCancelled to be handled first; OrderCancelled completes
// it, cancelled.
func (r *cancelRace) saga(name string, placed *bus.Topic[raceOrderPlaced], cancel *bus.Topic[raceOrderCancelled]) *bus.Saga[raceOrderState] {
	saga := bus.NewSaga[raceOrderState](name)
	bus.StartWith(saga, placed, func(m bus.Message[raceOrderPlaced]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[raceOrderState], m bus.Message[raceOrderPlaced]) error {
			select {
			case <-r.cancelled(sc.ID):
			case <-time.After(10 * time.Second):
			}
			sc.State.Status = "placed"
			return nil
		})
	bus.Then(saga, cancel, func(m bus.Message[raceOrderCancelled]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[raceOrderState], m bus.Message[raceOrderCancelled]) error {
			sc.State.Status = "cancelled"
			sc.Complete()
			return nil
		})
	return saga
}
