package bus_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// The order saga of the tests: order placed -> charge payment (with a
// payment timeout) -> reserve stock -> notify; a failed reservation
// refunds the payment, a payment timeout cancels the order.
type (
	sagaOrderPlaced   struct{ OrderID string }
	sagaCharged       struct{ OrderID string }
	sagaStockReserved struct{ OrderID string }
	sagaStockFailed   struct{ OrderID string }
	sagaPaymentLate   struct{ OrderID string }
	orderSagaState    struct {
		Step    string
		Charged bool
	}
)

func (sagaOrderPlaced) EventType() string               { return "OrderPlaced" }
func (e sagaOrderPlaced) Aggregate() (string, string)   { return "order", e.OrderID }
func (sagaCharged) EventType() string                   { return "PaymentCharged" }
func (e sagaCharged) Aggregate() (string, string)       { return "order", e.OrderID }
func (sagaStockReserved) EventType() string             { return "StockReserved" }
func (e sagaStockReserved) Aggregate() (string, string) { return "order", e.OrderID }
func (sagaStockFailed) EventType() string               { return "StockFailed" }
func (e sagaStockFailed) Aggregate() (string, string)   { return "order", e.OrderID }
func (sagaPaymentLate) EventType() string               { return "PaymentTimedOut" }
func (e sagaPaymentLate) Aggregate() (string, string)   { return "order", e.OrderID }

// sagaTopics are the order saga's topics, with a suffix of the test's for
// the tests on a broker.
type sagaTopics struct {
	orders   *bus.Topic[sagaOrderPlaced]
	payments *bus.Topic[sagaCharged]
	reserved *bus.Topic[sagaStockReserved]
	noStock  *bus.Topic[sagaStockFailed]
	timeouts *bus.Topic[sagaPaymentLate]
	commands string
}

func newSagaTopics(suffix string) sagaTopics {
	return sagaTopics{
		orders:   bus.Must(bus.NewTopic[sagaOrderPlaced]("orders.events" + suffix)),
		payments: bus.Must(bus.NewTopic[sagaCharged]("payments.events" + suffix)),
		reserved: bus.Must(bus.NewTopic[sagaStockReserved]("inventory.events" + suffix)),
		noStock:  bus.Must(bus.NewTopic[sagaStockFailed]("inventory.events" + suffix)),
		timeouts: bus.Must(bus.NewTopic[sagaPaymentLate]("orders.saga-timeouts" + suffix)),
		commands: "orders.commands" + suffix,
	}
}

var (
	sagaT         = newSagaTopics("")
	sagaOrders    = sagaT.orders
	sagaPayments  = sagaT.payments
	sagaReserved  = sagaT.reserved
	sagaNoStock   = sagaT.noStock
	sagaTimeouts  = sagaT.timeouts
	sagaCommandTo = sagaT.commands
)

func orderSaga(b *bus.Bus, paymentTimeout time.Duration, opts ...bus.SagaOption[orderSagaState]) *bus.Saga[orderSagaState] {
	return orderSagaOn(b, sagaT, paymentTimeout, opts...)
}

func orderSagaOn(b *bus.Bus, tp sagaTopics, paymentTimeout time.Duration, opts ...bus.SagaOption[orderSagaState]) *bus.Saga[orderSagaState] {
	sagaOrders, sagaPayments, sagaReserved, sagaNoStock, sagaTimeouts := tp.orders, tp.payments, tp.reserved, tp.noStock, tp.timeouts
	// command publishes a command of type typ for order id in the step's transaction.
	command := func(ctx context.Context, b *bus.Bus, typ, id string) error {
		return b.Publish(ctx, bus.Tx[bus.Execer](ctx), tp.commands, bus.Event{Type: typ, AggregateType: "order", AggregateID: id, Payload: []byte(`{}`)})
	}
	s := bus.NewSaga("order_fulfilment", opts...)
	bus.StartWith(s, sagaOrders, func(m bus.Message[sagaOrderPlaced]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[orderSagaState], m bus.Message[sagaOrderPlaced]) error {
			sc.State.Step = "charging"
			late, err := sagaTimeouts.Event(sagaPaymentLate{OrderID: sc.ID})
			if err != nil {
				return err
			}
			if err := sc.ScheduleTimeout(ctx, "payment", sagaTimeouts.Name(), bus.DueIn(paymentTimeout), late); err != nil {
				return err
			}
			return command(ctx, b, "ChargePayment", sc.ID)
		})
	bus.Then(s, sagaPayments, func(m bus.Message[sagaCharged]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[orderSagaState], m bus.Message[sagaCharged]) error {
			if err := sc.CancelTimeout(ctx, "payment"); err != nil {
				return err
			}
			sc.State.Step, sc.State.Charged = "reserving", true
			return command(ctx, b, "ReserveStock", sc.ID)
		})
	bus.Then(s, sagaReserved, func(m bus.Message[sagaStockReserved]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[orderSagaState], m bus.Message[sagaStockReserved]) error {
			sc.State.Step = "done"
			sc.Complete()
			return command(ctx, b, "NotifyCustomer", sc.ID)
		})
	bus.Then(s, sagaNoStock, func(m bus.Message[sagaStockFailed]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[orderSagaState], m bus.Message[sagaStockFailed]) error {
			sc.State.Step = "refunded"
			sc.Complete()
			return command(ctx, b, "RefundPayment", sc.ID) // the compensation
		})
	bus.Then(s, sagaTimeouts, func(m bus.Message[sagaPaymentLate]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[orderSagaState], m bus.Message[sagaPaymentLate]) error {
			if sc.State.Step != "charging" {
				return nil // the payment answered first
			}
			sc.State.Step = "cancelled"
			sc.Complete()
			return command(ctx, b, "CancelOrder", sc.ID)
		})
	return s
}

// sagaWorld drives a saga's handlers through the real consumer chain.
type sagaWorld struct {
	chainWorld
	chains map[string]message.NoPublishHandlerFunc
}

func newSagaWorld[S any](t *testing.T, w chainWorld, s *bus.Saga[S]) sagaWorld {
	routes, err := s.Routes(w.tb.bus)
	require.NoError(t, err)
	sw := sagaWorld{chainWorld: w, chains: map[string]message.NoPublishHandlerFunc{}}
	for topic, r := range routes {
		sw.chains[topic] = w.chain(t, "saga."+topic, r, bus.WithUnknownTypes(bus.AckUnknown))
	}
	return sw
}

// deliver hands ev to the saga's handler of topic as delivery id.
func (w sagaWorld) deliver(t *testing.T, topic, id string, ev bus.Event) {
	t.Helper()
	require.NoError(t, w.chains[topic](delivered(context.Background(), id, ev)), "delivery %s", id)
}

// commands counts the commands in the outbox by type.
func (w sagaWorld) commands(t *testing.T) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, r := range w.tb.outbox(t) {
		if r.topic == sagaCommandTo {
			out[r.event.Type]++
		}
	}
	return out
}

func (w sagaWorld) instance(t *testing.T, saga, id string) store.SagaRow {
	t.Helper()
	rows, err := w.tb.tables().ListSagas(context.Background(), w.tb.db, saga, true, -1)
	require.NoError(t, err)
	for _, r := range rows {
		if r.ID == id {
			return r
		}
	}
	t.Fatalf("saga %s %q not found", saga, id)
	return store.SagaRow{}
}

// The happy path sends each command once, cancels the payment timeout when
// the payment answers, and completes the saga.
func TestSagaHappyPath(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	sw := newSagaWorld(t, w, orderSaga(w.tb.bus, time.Hour))
	sw.deliver(t, "orders.events", "e1", mustEvent(t, sagaOrders, sagaOrderPlaced{OrderID: "o-1"}))
	require.Equal(t, 1, w.tb.scheduledCount(t), "the payment timeout waits")
	require.Equal(t, []string{"payment"}, keys(sw.instance(t, "order_fulfilment", "o-1").Timeouts))
	sw.deliver(t, "payments.events", "e2", mustEvent(t, sagaPayments, sagaCharged{OrderID: "o-1"}))
	require.Zero(t, w.tb.scheduledCount(t), "the payment timeout is cancelled when the payment answers")
	running, err := w.ops.ListSagas(context.Background(), ops.SagaFilter{Saga: "order_fulfilment"}, 10)
	require.NoError(t, err)
	require.Len(t, running.Instances, 1)
	require.Equal(t, "PaymentCharged", running.Instances[0].Step)
	sw.deliver(t, "inventory.events", "e3", mustEvent(t, sagaReserved, sagaStockReserved{OrderID: "o-1"}))
	running, err = w.ops.ListSagas(context.Background(), ops.SagaFilter{}, 10)
	require.NoError(t, err)
	require.Empty(t, running.Instances, "a completed saga is listed only with Completed")
	shown, err := w.ops.Saga(context.Background(), "order_fulfilment", "o-1")
	require.NoError(t, err)
	require.NotNil(t, shown.CompletedAt)
	require.Equal(t, "StockReserved", shown.Step)
	_, err = w.ops.Saga(context.Background(), "order_fulfilment", "nobody")
	require.ErrorIs(t, err, ops.ErrNotFound)

	require.Equal(t, map[string]int{"ChargePayment": 1, "ReserveStock": 1, "NotifyCustomer": 1}, sw.commands(t))
	row := sw.instance(t, "order_fulfilment", "o-1")
	require.False(t, row.Completed.IsZero(), "completed")
	require.Equal(t, int64(3), row.Version)
	require.JSONEq(t, `{"Step":"done","Charged":true}`, string(row.State))
}

func keys(m map[string]string) []string {
	out := []string{}
	for k := range m {
		out = append(out, k)
	}
	return out
}

// A replay for other consumer groups starts no saga instance and sends no
// command: the chain acks it before the saga's step (not_targeted). The
// same replay for the saga's own group runs the step.
func TestSagaIgnoresAReplayForOtherGroups(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	sw := newSagaWorld(t, w, orderSaga(w.tb.bus, time.Hour))
	replay := func(groups string) *message.Message {
		msg := delivered(context.Background(), "e1", mustEvent(t, sagaOrders, sagaOrderPlaced{OrderID: "o-1"}))
		msg.Metadata.Set(middleware.ReplayOfKey, "e0")
		msg.Metadata.Set(middleware.ReplayGroupsKey, groups)
		return msg
	}
	require.NoError(t, sw.chains["orders.events"](replay("billing,analytics")))
	rows, err := w.tb.tables().ListSagas(context.Background(), w.tb.db, "order_fulfilment", true, -1)
	require.NoError(t, err)
	require.Empty(t, rows, "no saga started")
	require.Empty(t, sw.commands(t))
	require.EqualValues(t, 1, w.counter(t, middleware.MetricMessages, map[string]string{"handler": "saga.orders.events", "outcome": middleware.OutcomeNotTargeted}))

	require.NoError(t, sw.chains["orders.events"](replay("billing,saga.orders.events")))
	require.Equal(t, map[string]int{"ChargePayment": 1}, sw.commands(t))
	require.Equal(t, "OrderPlaced", sw.instance(t, "order_fulfilment", "o-1").Step)
}

// A failed reservation after the payment sends the refund once, even when
// every event is delivered twice; an event of the completed saga is
// ignored and counted.
func TestSagaCompensationOnceWithDuplicateDeliveries(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	sw := newSagaWorld(t, w, orderSaga(w.tb.bus, time.Hour))
	steps := []struct {
		topic, id string
		ev        bus.Event
	}{
		{"orders.events", "e1", mustEvent(t, sagaOrders, sagaOrderPlaced{OrderID: "o-2"})},
		{"payments.events", "e2", mustEvent(t, sagaPayments, sagaCharged{OrderID: "o-2"})},
		{"inventory.events", "e3", mustEvent(t, sagaNoStock, sagaStockFailed{OrderID: "o-2"})},
	}
	for _, s := range steps {
		sw.deliver(t, s.topic, s.id, s.ev)
		sw.deliver(t, s.topic, s.id, s.ev) // a redelivery: the consumer died between commit and ack
	}
	for _, s := range steps { // and all of them again, late
		sw.deliver(t, s.topic, s.id, s.ev)
	}
	require.Equal(t, map[string]int{"ChargePayment": 1, "ReserveStock": 1, "RefundPayment": 1}, sw.commands(t))
	row := sw.instance(t, "order_fulfilment", "o-2")
	require.JSONEq(t, `{"Step":"refunded","Charged":true}`, string(row.State))
	require.Equal(t, int64(3), row.Version, "each step applied once")

	// A new delivery (another event id) for the completed saga is unmatched.
	sw.deliver(t, "payments.events", "e4", mustEvent(t, sagaPayments, sagaCharged{OrderID: "o-2"}))
	require.Equal(t, 1, sw.commands(t)["ReserveStock"])
	require.Equal(t, 1.0, w.counter(t, bus.MetricSagaUnmatched, map[string]string{"saga": "order_fulfilment", "event_type": "PaymentCharged"}))
}

// A payment that does not answer: the timeout, a scheduled event to the
// saga itself, falls due, and its step cancels the order; the late payment
// then matches no running saga and sends nothing.
func TestSagaTimeoutCompensates(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	sw := newSagaWorld(t, w, orderSaga(w.tb.bus, 0))
	sw.deliver(t, "orders.events", "e1", mustEvent(t, sagaOrders, sagaOrderPlaced{OrderID: "o-3"}))
	moved, _, _, err := w.tb.tables().MoveDue(context.Background(), w.tb.db, 10)
	require.NoError(t, err)
	require.Equal(t, 1, moved, "the timeout fell due")
	var timeout *outboxRow
	for _, r := range w.tb.outbox(t) {
		if r.topic == "orders.saga-timeouts" {
			timeout = &r
		}
	}
	require.NotNil(t, timeout, "the timeout is in the outbox")
	sw.deliver(t, "orders.saga-timeouts", timeout.event.ID, timeout.event)
	sw.deliver(t, "payments.events", "e2", mustEvent(t, sagaPayments, sagaCharged{OrderID: "o-3"}))
	require.Equal(t, map[string]int{"ChargePayment": 1, "CancelOrder": 1}, sw.commands(t))
	require.JSONEq(t, `{"Step":"cancelled","Charged":false}`, string(sw.instance(t, "order_fulfilment", "o-3").State))
}

// An event for no running instance is poisoned under PoisonUnmatched.
func TestSagaUnmatchedPoison(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	sw := newSagaWorld(t, w, orderSaga(w.tb.bus, time.Hour, bus.WithUnmatched[orderSagaState](bus.PoisonUnmatched)))
	sw.deliver(t, "payments.events", "e1", mustEvent(t, sagaPayments, sagaCharged{OrderID: "nobody"}))
	require.Contains(t, w.poisonReasons(t, "saga.payments.events")["e1"], "no running saga instance")
	require.Empty(t, sw.commands(t))
}

type counterState struct{ Sum int }

type (
	counterOpened struct{ ID string }
	counterAdded  struct {
		ID string
		N  int
	}
)

func (counterOpened) EventType() string             { return "CounterOpened" }
func (e counterOpened) Aggregate() (string, string) { return "counter", e.ID }
func (counterAdded) EventType() string              { return "CounterAdded" }
func (e counterAdded) Aggregate() (string, string)  { return "counter", e.ID }

// Two events for one saga at the same moment on two consumers: both load
// the same version; the second save meets the first's and the step runs
// again on the state the first left. No update is lost.
func TestSagaConcurrentStepsLoseNoUpdate(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	opened := bus.Must(bus.NewTopic[counterOpened]("counters"))
	added := bus.Must(bus.NewTopic[counterAdded]("counters"))
	var calls atomic.Int32
	var loaded sync.WaitGroup
	loaded.Add(2)
	s := bus.NewSaga[counterState]("counter")
	bus.StartWith(s, opened, func(m bus.Message[counterOpened]) string { return m.Value.ID },
		func(ctx context.Context, sc *bus.SagaContext[counterState], m bus.Message[counterOpened]) error {
			return nil
		})
	bus.Then(s, added, func(m bus.Message[counterAdded]) string { return m.Value.ID },
		func(ctx context.Context, sc *bus.SagaContext[counterState], m bus.Message[counterAdded]) error {
			if calls.Add(1) <= 2 {
				loaded.Done()
				loaded.Wait() // both steps have loaded the same version
			}
			sc.State.Sum += m.Value.N
			return nil
		})
	sw := newSagaWorld(t, w, s)
	sw.deliver(t, "counters", "open", mustEvent(t, opened, counterOpened{ID: "c-1"}))
	var wg sync.WaitGroup
	for i, n := range []int{1, 2} {
		wg.Go(func() {
			ev := mustEvent(t, added, counterAdded{ID: "c-1", N: n})
			require.NoError(t, sw.chains["counters"](delivered(context.Background(), "add-"+watermill.NewShortUUID()+string(rune('a'+i)), ev)))
		})
	}
	wg.Wait()
	row := sw.instance(t, "counter", "c-1")
	require.JSONEq(t, `{"Sum":3}`, string(row.State), "no lost update")
	require.Equal(t, int64(3), row.Version)
	require.GreaterOrEqual(t, calls.Load(), int32(3), "the conflicting step ran again")
}

// Declaration mistakes are errors of Routes (and Handle) naming the step.
func TestSagaRegistrationErrors(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	correlate := func(m bus.Message[sagaOrderPlaced]) string { return m.Value.OrderID }
	noop := func(ctx context.Context, sc *bus.SagaContext[orderSagaState], m bus.Message[sagaOrderPlaced]) error {
		return nil
	}

	twoStarts := bus.NewSaga[orderSagaState]("twice")
	bus.StartWith(twoStarts, sagaOrders, correlate, noop)
	bus.StartWith(twoStarts, sagaOrders, correlate, noop)
	_, err := twoStarts.Routes(w.tb.bus)
	require.ErrorContains(t, err, `saga "twice"`)
	require.ErrorContains(t, err, `two starting steps for event type "OrderPlaced" on topic "orders.events"`)

	noHandler := bus.NewSaga[orderSagaState]("nohandler")
	bus.StartWith(noHandler, sagaOrders, correlate, nil)
	bus.Then(noHandler, sagaPayments, nil, func(ctx context.Context, sc *bus.SagaContext[orderSagaState], m bus.Message[sagaCharged]) error {
		return nil
	})
	err = noHandler.Handle(w.tb.bus, "nohandler")
	require.ErrorContains(t, err, `StartWith step for event type "OrderPlaced": the step has no handler`)
	require.ErrorContains(t, err, `Then step for event type "PaymentCharged": no correlation`)

	noStart := bus.NewSaga[orderSagaState]("nostart")
	bus.Then(noStart, sagaPayments, func(m bus.Message[sagaCharged]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[orderSagaState], m bus.Message[sagaCharged]) error {
			return nil
		})
	_, err = noStart.Routes(w.tb.bus)
	require.ErrorContains(t, err, "no StartWith step")
}

// A saga's handlers take batches of at most MaxSagaBatchMessages: Handle
// names the YAML path that sets a larger one, the handler's own or the
// consumer's.
func TestSagaRefusesBatchesTooLarge(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, path string
		change     func(*bus.Config)
	}{
		{"consumer", "consumer.batch.max_messages", func(c *bus.Config) {
			c.Consumer.Batch.MaxMessages = bus.MaxSagaBatchMessages + 1
		}},
		{"handler", "consumer.handlers.big.orders.events.batch.max_messages", func(c *bus.Config) {
			var h middleware.Config
			h.Batch.MaxMessages = bus.MaxSagaBatchMessages + 1
			c.Consumer.Handlers = map[string]middleware.Config{"big.orders.events": h}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			w := newChainWorld(t, tc.change)
			err := orderSaga(w.tb.bus, time.Hour).Handle(w.tb.bus, "big")
			var fe *bus.FieldError
			require.ErrorAs(t, err, &fe)
			require.Equal(t, tc.path, fe.Path)
			require.ErrorContains(t, err, fmt.Sprintf("must be at most %d", bus.MaxSagaBatchMessages))
		})
	}
	w := newChainWorld(t, func(c *bus.Config) { c.Consumer.Batch.MaxMessages = bus.MaxSagaBatchMessages })
	require.NoError(t, orderSaga(w.tb.bus, time.Hour).Handle(w.tb.bus, "big"))
}

// The order saga on a real broker, with the payment and inventory services
// as handlers that answer its commands: an order whose stock is missing is
// refunded once, the other is notified once, and both sagas complete.
func TestSagaEndToEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newChainWorld(t, func(c *bus.Config) {
		brokertest.Apply(t, bus.KindNATS, c)
		c.Relay.PollInterval = 50 * time.Millisecond
	})
	suffix := "-" + testdb.UniqueName("")[3:]
	tp := newSagaTopics(suffix)
	for _, topic := range []string{tp.orders.Name(), tp.payments.Name(), tp.reserved.Name(), tp.timeouts.Name(), tp.commands} {
		brokertest.Cleanup(t, bus.KindNATS, topic, "saga"+suffix+"."+topic, "payments"+suffix, "inventory"+suffix)
	}
	b := w.tb.bus
	require.NoError(t, orderSagaOn(b, tp, time.Hour).Handle(b, "saga"+suffix))
	require.NoError(t, b.Handle(tp.commands, "payments"+suffix, func(ctx context.Context, ev bus.Event) error {
		if ev.Type != "ChargePayment" {
			return nil
		}
		return tp.payments.Publish(ctx, b, bus.Tx[bus.Execer](ctx), sagaCharged{OrderID: ev.AggregateID})
	}))
	require.NoError(t, b.Handle(tp.commands, "inventory"+suffix, func(ctx context.Context, ev bus.Event) error {
		switch {
		case ev.Type != "ReserveStock":
			return nil
		case ev.AggregateID == "o-missing":
			return tp.noStock.Publish(ctx, b, bus.Tx[bus.Execer](ctx), sagaStockFailed{OrderID: ev.AggregateID})
		}
		return tp.reserved.Publish(ctx, b, bus.Tx[bus.Execer](ctx), sagaStockReserved{OrderID: ev.AggregateID})
	}))
	running := testkit.Start(t, b.Run)
	t.Cleanup(func() { require.NoError(t, running.Stop(t, time.Minute)) })

	tx, err := w.tb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tp.orders.Publish(ctx, b, tx, sagaOrderPlaced{OrderID: "o-ok"}, sagaOrderPlaced{OrderID: "o-missing"}))
	require.NoError(t, tx.Commit())

	testkit.Eventually(t, 2*time.Minute, "both sagas completed", func() bool {
		list, err := w.ops.ListSagas(ctx, ops.SagaFilter{Completed: true}, 0)
		require.NoError(t, err)
		completed := 0
		for _, inst := range list.Instances {
			if inst.CompletedAt != nil {
				completed++
			}
		}
		return completed == 2
	})
	commands := map[string]int{}
	for _, r := range w.tb.outbox(t) {
		if r.topic == tp.commands {
			commands[r.event.AggregateID+" "+r.event.Type]++
		}
	}
	require.Equal(t, map[string]int{
		"o-ok ChargePayment": 1, "o-ok ReserveStock": 1, "o-ok NotifyCustomer": 1,
		"o-missing ChargePayment": 1, "o-missing ReserveStock": 1, "o-missing RefundPayment": 1,
	}, commands)
	ok, err := w.ops.Saga(ctx, "order_fulfilment", "o-ok")
	require.NoError(t, err)
	require.JSONEq(t, `{"Step":"done","Charged":true}`, string(ok.State))
	require.Empty(t, ok.Timeouts, "the payment timeout was cancelled")
	require.Zero(t, w.tb.scheduledCount(t))
}

// Two Buses on one registry share millrace_saga_unmatched_total.
func TestSagaOnTwoBusesSharingARegistry(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	other, err := bus.Open(context.Background(), w.tb.cfg, w.tb.db, bus.WithRegistry(w.reg))
	require.NoError(t, err)
	defer other.Close()
	_, err = orderSaga(w.tb.bus, time.Hour).Routes(w.tb.bus)
	require.NoError(t, err)
	_, err = orderSaga(other, time.Hour).Routes(other)
	require.NoError(t, err)
}

// A failing step's error is kept for `millrace saga show` although its
// transaction rolled back: current while the saga has not moved on, marked
// as earlier once a later step commits. A starting step that failed shows
// an instance at version 0.
func TestSagaShowsItsLastError(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	opened := bus.Must(bus.NewTopic[counterOpened]("counters"))
	added := bus.Must(bus.NewTopic[counterAdded]("counters"))
	s := bus.NewSaga[counterState]("counter")
	bus.StartWith(s, opened, func(m bus.Message[counterOpened]) string { return m.Value.ID },
		func(ctx context.Context, sc *bus.SagaContext[counterState], m bus.Message[counterOpened]) error {
			if m.Value.ID == "c-broken" {
				return bus.Permanent(errors.New("cannot open c-broken"))
			}
			return nil
		})
	bus.Then(s, added, func(m bus.Message[counterAdded]) string { return m.Value.ID },
		func(ctx context.Context, sc *bus.SagaContext[counterState], m bus.Message[counterAdded]) error {
			if m.Value.N < 0 {
				return bus.Permanent(fmt.Errorf("cannot add %d", m.Value.N))
			}
			sc.State.Sum += m.Value.N
			return nil
		})
	sw := newSagaWorld(t, w, s)
	ctx := context.Background()
	sw.deliver(t, "counters", "open", mustEvent(t, opened, counterOpened{ID: "c-1"}))
	shown, err := w.ops.Saga(ctx, "counter", "c-1")
	require.NoError(t, err)
	require.Nil(t, shown.LastError, "no step has failed")

	sw.deliver(t, "counters", "bad-add", mustEvent(t, added, counterAdded{ID: "c-1", N: -1}))
	require.Contains(t, w.poisonReasons(t, "saga.counters")["bad-add"], "cannot add -1")
	shown, err = w.ops.Saga(ctx, "counter", "c-1")
	require.NoError(t, err)
	require.NotNil(t, shown.LastError)
	require.Equal(t, "CounterAdded", shown.LastError.Step)
	require.Contains(t, shown.LastError.Error, "cannot add -1")
	require.True(t, shown.LastError.Current, "the saga has not moved on since")
	require.Equal(t, int64(1), shown.Version, "the failed step kept nothing")

	sw.deliver(t, "counters", "good-add", mustEvent(t, added, counterAdded{ID: "c-1", N: 2}))
	shown, err = w.ops.Saga(ctx, "counter", "c-1")
	require.NoError(t, err)
	require.NotNil(t, shown.LastError)
	require.False(t, shown.LastError.Current, "a later step committed")
	require.JSONEq(t, `{"Sum":2}`, string(shown.State))

	sw.deliver(t, "counters", "bad-open", mustEvent(t, opened, counterOpened{ID: "c-broken"}))
	shown, err = w.ops.Saga(ctx, "counter", "c-broken")
	require.NoError(t, err, "an instance whose start failed is shown with its error")
	require.Zero(t, shown.Version)
	require.NotNil(t, shown.LastError)
	require.Equal(t, "CounterOpened", shown.LastError.Step)
	require.True(t, shown.LastError.Current)
	require.Contains(t, shown.LastError.Error, "cannot open c-broken")
}
