package bus_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// The order saga of the tests: order placed -> charge payment (with a
// payment timeout) -> reserve stock -> notify; a failed reservation
// refunds the payment, a payment timeout cancels the order.
type (
	sagaOrderPlaced   struct{ orderRef }
	sagaCharged       struct{ orderRef }
	sagaStockReserved struct{ orderRef }
	sagaStockFailed   struct{ orderRef }
	sagaPaymentLate   struct{ orderRef }
	orderSagaState    struct {
		Step    string
		Charged bool
	}
)

// orderRef is the order a saga event is about, its aggregate.
type orderRef struct{ OrderID string }

func (e orderRef) Aggregate() (string, string) { return "order", e.OrderID }

func (sagaOrderPlaced) EventType() string   { return "OrderPlaced" }
func (sagaCharged) EventType() string       { return "PaymentCharged" }
func (sagaStockReserved) EventType() string { return "StockReserved" }
func (sagaStockFailed) EventType() string   { return "StockFailed" }
func (sagaPaymentLate) EventType() string   { return "PaymentTimedOut" }

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
			late, err := sagaTimeouts.Event(sagaPaymentLate{orderRef{sc.ID}})
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
	sw.deliver(t, "orders.events", "e1", mustEvent(t, sagaOrders, sagaOrderPlaced{orderRef{"o-1"}}))
	require.Equal(t, 1, w.tb.scheduledCount(t), "the payment timeout waits")
	require.Equal(t, []string{"payment"}, keys(sw.instance(t, "order_fulfilment", "o-1").Timeouts))
	sw.deliver(t, "payments.events", "e2", mustEvent(t, sagaPayments, sagaCharged{orderRef{"o-1"}}))
	require.Zero(t, w.tb.scheduledCount(t), "the payment timeout is cancelled when the payment answers")
	running, err := w.ops.ListSagas(context.Background(), ops.SagaFilter{Saga: "order_fulfilment"}, 10)
	require.NoError(t, err)
	require.Len(t, running.Instances, 1)
	require.Equal(t, "PaymentCharged", running.Instances[0].Step)
	sw.deliver(t, "inventory.events", "e3", mustEvent(t, sagaReserved, sagaStockReserved{orderRef{"o-1"}}))
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
		msg := delivered(context.Background(), "e1", mustEvent(t, sagaOrders, sagaOrderPlaced{orderRef{"o-1"}}))
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
		{"orders.events", "e1", mustEvent(t, sagaOrders, sagaOrderPlaced{orderRef{"o-2"}})},
		{"payments.events", "e2", mustEvent(t, sagaPayments, sagaCharged{orderRef{"o-2"}})},
		{"inventory.events", "e3", mustEvent(t, sagaNoStock, sagaStockFailed{orderRef{"o-2"}})},
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
	sw.deliver(t, "payments.events", "e4", mustEvent(t, sagaPayments, sagaCharged{orderRef{"o-2"}}))
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
	sw.deliver(t, "orders.events", "e1", mustEvent(t, sagaOrders, sagaOrderPlaced{orderRef{"o-3"}}))
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
	sw.deliver(t, "payments.events", "e2", mustEvent(t, sagaPayments, sagaCharged{orderRef{"o-3"}}))
	require.Equal(t, map[string]int{"ChargePayment": 1, "CancelOrder": 1}, sw.commands(t))
	require.JSONEq(t, `{"Step":"cancelled","Charged":false}`, string(sw.instance(t, "order_fulfilment", "o-3").State))
}

// An event for no running instance is poisoned under PoisonUnmatched.
func TestSagaUnmatchedPoison(t *testing.T) {
	t.Parallel()
	w := newChainWorld(t)
	sw := newSagaWorld(t, w, orderSaga(w.tb.bus, time.Hour, bus.WithUnmatched[orderSagaState](bus.PoisonUnmatched)))
	sw.deliver(t, "payments.events", "e1", mustEvent(t, sagaPayments, sagaCharged{orderRef{"nobody"}}))
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
	suffix := "-" + testkit.Suffix()
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
		return tp.payments.Publish(ctx, b, bus.Tx[bus.Execer](ctx), sagaCharged{orderRef{ev.AggregateID}})
	}))
	require.NoError(t, b.Handle(tp.commands, "inventory"+suffix, func(ctx context.Context, ev bus.Event) error {
		switch {
		case ev.Type != "ReserveStock":
			return nil
		case ev.AggregateID == "o-missing":
			return tp.noStock.Publish(ctx, b, bus.Tx[bus.Execer](ctx), sagaStockFailed{orderRef{ev.AggregateID}})
		}
		return tp.reserved.Publish(ctx, b, bus.Tx[bus.Execer](ctx), sagaStockReserved{orderRef{ev.AggregateID}})
	}))
	running := testkit.Start(t, b.Run)
	t.Cleanup(func() { require.NoError(t, running.Stop(t, time.Minute)) })

	tx, err := w.tb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tp.orders.Publish(ctx, b, tx, sagaOrderPlaced{orderRef{"o-ok"}}, sagaOrderPlaced{orderRef{"o-missing"}}))
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
	suffix := "-" + testkit.Suffix()
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

type (
	raceOrderPlaced    struct{ orderRef }
	raceOrderCancelled struct{ orderRef }
	raceOrderState     struct{ Status string }
)

func (raceOrderPlaced) EventType() string    { return "OrderPlaced" }
func (raceOrderCancelled) EventType() string { return "OrderCancelled" }

// A saga's events of one instance are handled in order by default, on
// every broker: 15 orders placed and cancelled at once, each OrderPlaced
// step waiting (up to 10s) for its order's OrderCancelled to be handled
// first. With consumer.handlers.<saga>.ordered: false, as before, the
// cancellations overtake their OrderPlaced, find no saga and are ignored;
// by default none does, and every saga ends cancelled.
func TestSagaHandlesAnInstancesEventsInOrder(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, func(t *testing.T, kind string) {
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

const raceOrders = 15

// runCancelRace runs the race on kind with the saga handler's ordered
// override and returns how many cancellations found no saga and how many
// sagas ended cancelled.
func runCancelRace(t *testing.T, kind string, ordered *bool) (overtaken, cancelled int) {
	ctx := context.Background()
	suffix := "_" + testkit.Suffix()
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
		tx := tb.begin(t)
		require.NoError(t, placed.Publish(ctx, b, tx, raceOrderPlaced{orderRef{id}}))
		require.NoError(t, cancel.Publish(ctx, b, tx, raceOrderCancelled{orderRef{id}}))
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
