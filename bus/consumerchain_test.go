package bus_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/middleware"
)

// ConsumerChain checks what Handle checks, and what the chain needs.
func TestConsumerChainRefusesBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	svc := brokertest.NewService(t, bus.KindNATS)
	b := svc.Open(t) // the broker is never dialed

	_, err := b.ConsumerChain(ctx, "orders events", "", nil, nil)
	require.ErrorContains(t, err, `millrace: ConsumerChain("orders events", "")`)
	require.ErrorContains(t, err, "topic: must match")
	require.ErrorContains(t, err, "handler name: must not be empty")
	require.ErrorContains(t, err, "handler func is nil")

	cfg := svc.Config
	cfg.Consumer.Poison = middleware.PoisonConfig{Destination: middleware.PoisonToTopic, Topic: "orders.poison"}
	topicPoison, err := bus.Open(ctx, cfg, svc.DB)
	require.NoError(t, err)
	defer topicPoison.Close()
	noop := func(context.Context, bus.Event) error { return nil }
	_, err = topicPoison.ConsumerChain(ctx, "orders.events", "billing", noop, nil)
	require.ErrorContains(t, err, "poison.destination is topic but Deps.PoisonPublisher is nil")

	// Each call builds a stack of its own, as a restarted process would, so
	// the same handler may be built again.
	for range 2 {
		_, err = b.ConsumerChain(ctx, "orders.events", "billing", noop, nil)
		require.NoError(t, err)
	}
}
