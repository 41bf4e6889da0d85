package bus_test

import (
	"context"
	"fmt"
	"time"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
)

type (
	// PaymentCharged moves the saga on (OrderPlaced, of the typed
	// example, starts it).
	PaymentCharged struct{ OrderID string }
	// PaymentTimedOut is the saga's own timeout.
	PaymentTimedOut struct{ OrderID string }
	// OrderSaga is the saga's state.
	OrderSaga struct{ Step string }
)

func (PaymentCharged) EventType() string              { return "PaymentCharged" }
func (e PaymentCharged) Aggregate() (string, string)  { return "order", e.OrderID }
func (PaymentTimedOut) EventType() string             { return "PaymentTimedOut" }
func (e PaymentTimedOut) Aggregate() (string, string) { return "order", e.OrderID }

// A saga: an order starts it, which charges the payment and schedules a
// timeout; the payment moves it on and cancels the timeout. Declaration
// mistakes are errors of Handle, naming the step.
func ExampleNewSaga() {
	b, _, closeAll := brokertest.NewExampleBus("example_saga")
	defer closeAll()

	orders := bus.Must(bus.NewTopic[OrderPlaced]("orders.events"))
	payments := bus.Must(bus.NewTopic[PaymentCharged]("payments.events"))
	timeouts := bus.Must(bus.NewTopic[PaymentTimedOut]("orders.saga-timeouts"))
	byAggregate := func(m bus.Message[OrderPlaced]) string { return m.AggregateID }

	saga := bus.NewSaga[OrderSaga]("order_fulfilment")
	bus.StartWith(saga, orders, byAggregate,
		func(ctx context.Context, sc *bus.SagaContext[OrderSaga], m bus.Message[OrderPlaced]) error {
			sc.State.Step = "charging"
			late, err := timeouts.Event(PaymentTimedOut{OrderID: sc.ID})
			if err != nil {
				return err
			}
			if err := sc.ScheduleTimeout(ctx, "payment", timeouts.Name(), bus.DueIn(10*time.Minute), late); err != nil {
				return err
			}
			return b.Publish(ctx, bus.Tx[bus.Execer](ctx), "payments.commands", bus.Event{Type: "ChargePayment",
				AggregateType: "order", AggregateID: sc.ID, Payload: []byte(`{}`)})
		})
	bus.Then(saga, payments, func(m bus.Message[PaymentCharged]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[OrderSaga], m bus.Message[PaymentCharged]) error {
			sc.State.Step = "paid"
			sc.Complete() // cancels the payment timeout too
			return nil
		})
	fmt.Println("registered:", saga.Handle(b, "order-saga") == nil)

	broken := bus.NewSaga[OrderSaga]("broken")
	bus.StartWith(broken, orders, byAggregate, nil)
	fmt.Println(broken.Handle(b, "broken"))
	// Output:
	// registered: true
	// millrace: saga "broken": StartWith step for event type "OrderPlaced": the step has no handler (its func is nil)
}
