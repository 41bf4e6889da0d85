package bus_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/middleware"
)

// paymentSaga is a saga reading two topics, so that its handlers are
// name.<topic>.
func paymentSaga() *bus.Saga[OrderSaga] {
	orders := bus.Must(bus.NewTopic[placedV2]("orders.events"))
	payments := bus.Must(bus.NewTopic[PaymentCharged]("payments.events"))
	step := func(ctx context.Context, sc *bus.SagaContext[OrderSaga], _ bus.Message[placedV2]) error { return nil }
	paid := func(ctx context.Context, sc *bus.SagaContext[OrderSaga], _ bus.Message[PaymentCharged]) error {
		return nil
	}
	s := bus.NewSaga[OrderSaga]("payment")
	bus.StartWith(s, orders, func(m bus.Message[placedV2]) string { return m.AggregateID }, step)
	bus.Then(s, payments, func(m bus.Message[PaymentCharged]) string { return m.Value.OrderID }, paid)
	return s
}

// A misspelt override under consumer.handlers fails Run before anything
// connects, naming its YAML path and the registered handlers; the names
// Saga.Handlers gives are registered ones.
func TestRunRefusesAnOverrideOfNoHandler(t *testing.T) {
	t.Parallel()
	saga := paymentSaga()
	sagaHandlers := saga.Handlers("checkout")
	require.Equal(t, []string{"checkout.orders.events", "checkout.payments.events"}, sagaHandlers)
	tb := setup(t, func(c *bus.Config) {
		c.Consumer.Handlers = map[string]middleware.Config{
			"billing":       {Workers: 2},
			"biling":        {Workers: 3},
			sagaHandlers[1]: {Workers: 1},
			"checkout":      {Workers: 1}, // the saga reads two topics: no handler is called checkout
		}
	})
	nop := func(context.Context, bus.Event) error { return nil }
	require.NoError(t, tb.bus.Handle("orders.events", "billing", nop))
	require.NoError(t, saga.Handle(tb.bus, "checkout"))

	err := tb.bus.Run(context.Background())
	var ce *bus.ConfigError
	require.True(t, errors.As(err, &ce), "%v", err)
	var got []string
	for _, p := range ce.Problems {
		got = append(got, p.Error())
	}
	registered := "billing, checkout.orders.events, checkout.payments.events"
	require.Equal(t, []string{
		`consumer.handlers.biling: no handler "biling" is registered; the registered handlers are ` + registered,
		`consumer.handlers.checkout: no handler "checkout" is registered; the registered handlers are ` + registered,
	}, got)
}

// Every registration on a closed Bus returns ErrClosed, and so does Run.
func TestRegistrationsAfterCloseReturnErrClosed(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	require.NoError(t, tb.bus.Close())
	orders := bus.Must(bus.NewTopic[placedV2]("orders.events"))
	for name, err := range map[string]error{
		"Handle": tb.bus.Handle("orders.events", "billing", func(context.Context, bus.Event) error { return nil }),
		"HandleBatch": tb.bus.HandleBatch("orders.events", "ledger",
			func(context.Context, []bus.Event) error { return nil }),
		"Topic.Handle": orders.Handle(tb.bus, "typed",
			func(context.Context, bus.Message[placedV2]) error { return nil }),
		"Topic.HandleBatch": orders.HandleBatch(tb.bus, "typed-batch",
			func(context.Context, []bus.Message[placedV2]) error { return nil }),
		"HandleTypes": tb.bus.HandleTypes("routes", []bus.Route{bus.On(orders,
			func(context.Context, bus.Message[placedV2]) error { return nil })}),
		"Saga.Handle": paymentSaga().Handle(tb.bus, "checkout"),
		"Run":         tb.bus.Run(context.Background()),
	} {
		require.ErrorIs(t, err, bus.ErrClosed, name)
	}
}
