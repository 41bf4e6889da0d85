package bus_test

import (
	"context"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

// Run consumes an ordered handler's group on NATS through the ordered
// subscriber, whose consumer has the handler's consumer.prefetch as its
// max_ack_pending (many messages in flight, at most one per aggregate), and
// leaves the other handlers' at broker.nats.consumer.max_ack_pending.
func TestRunProvisionsOrderedGroupsOnNATS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	svc := brokertest.NewService(t, bus.KindNATS, func(cfg *bus.Config) {
		cfg.Relay.Enabled = new(bool)
		cfg.Consumer.Handlers = map[string]middleware.Config{"ledger": {Ordered: new(true), Workers: 4, Prefetch: 12}}
	})
	cfg := svc.Config
	b := svc.Open(t)
	topic := "orders-" + testdb.UniqueName("")[2:]
	nop := func(context.Context, bus.Event) error { return nil }
	require.NoError(t, b.Handle(topic, "ledger", nop, bus.WithConsumerGroup("ledger-"+topic)))
	require.NoError(t, b.Handle(topic, "mailer", nop, bus.WithConsumerGroup("mailer-"+topic)))
	brokertest.Cleanup(t, bus.KindNATS, topic, "ledger-"+topic, "mailer-"+topic)

	running := testkit.Start(t, b.Run)
	defer func() { require.NoError(t, running.Stop(t, time.Minute)) }()

	nc, err := natsgo.Connect(cfg.WithDefaults().Broker.NATS.URL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	maxAckPending := func(group string) int {
		c, err := js.PushConsumer(ctx, nats.StreamName(topic), nats.ConsumerName(group))
		if err != nil {
			return 0
		}
		return c.CachedInfo().Config.MaxAckPending
	}
	testkit.Eventually(t, 30*time.Second, "the ordered subscriber took its group's lease", func() bool {
		return maxAckPending("ledger-"+topic) == 12 && maxAckPending("mailer-"+topic) > 0
	})
	require.Equal(t, 32, maxAckPending("mailer-"+topic), "broker.nats.consumer.max_ack_pending's default")
}
