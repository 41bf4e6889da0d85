package bus_test

import (
	"context"
	"fmt"

	"github.com/millrace-io/millrace/bus"
)

// The names of a saga's handlers are known before it is registered: the
// keys of its overrides under consumer.handlers, and its consumer groups
// to provision. A saga reading two topics has one handler per topic.
func ExampleSaga_Handlers() {
	orders := bus.Must(bus.NewTopic[OrderPlaced]("orders.events"))
	payments := bus.Must(bus.NewTopic[PaymentCharged]("payments.events"))
	start := func(ctx context.Context, sc *bus.SagaContext[OrderSaga], m bus.Message[OrderPlaced]) error {
		return nil
	}
	paid := func(ctx context.Context, sc *bus.SagaContext[OrderSaga], m bus.Message[PaymentCharged]) error {
		return nil
	}

	saga := bus.NewSaga[OrderSaga]("order_fulfilment")
	bus.StartWith(saga, orders, func(m bus.Message[OrderPlaced]) string { return m.AggregateID }, start)
	bus.Then(saga, payments, func(m bus.Message[PaymentCharged]) string { return m.Value.OrderID }, paid)
	for _, name := range saga.Handlers("order-saga") {
		fmt.Println("consumer.handlers." + name)
	}
	// Output:
	// consumer.handlers.order-saga.orders.events
	// consumer.handlers.order-saga.payments.events
}
