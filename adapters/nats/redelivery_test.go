package nats

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// A RedeliverySubscriber's messages carry their JetStream delivery count,
// also in a new subscriber after the first closed, and a nacked message
// waits wait(n) of the delivery n that was nacked, not consumer.nak_delay.
func TestRedeliverySubscriberNumbersDeliveries(t *testing.T) {
	t.Parallel()
	b := openBroker(t, sharedURL(), func(c *Config) { c.Consumer.NakDelay = time.Hour })
	topic, group := adaptertest.Name("redeliver"), adaptertest.Name("g")
	wait, asked := adaptertest.ShortFirstWait(10 * time.Millisecond)
	subscribe := func() (<-chan *struct{ n int }, func()) {
		deliveries := &adapters.Deliveries{}
		sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group, RedeliveryWait: wait, Deliveries: deliveries})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		out := make(chan *struct{ n int }, 1)
		go func() {
			for m := range ch {
				n, ok := deliveries.Number(m)
				require.True(t, ok, "no delivery number")
				m.Nack()
				out <- &struct{ n int }{n}
			}
		}()
		return out, func() { cancel(); require.NoError(t, sub.Close()) }
	}
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("r1"))))

	first, closeFirst := subscribe()
	require.Equal(t, 1, (<-first).n)
	require.Equal(t, 1, <-asked)
	closeFirst() // the nak of delivery 1 (10ms) is sent before Close returns

	second, closeSecond := subscribe()
	defer closeSecond()
	select {
	case got := <-second:
		require.Equal(t, 2, got.n, "the count survives a new subscriber")
	case <-time.After(30 * time.Second):
		require.FailNow(t, "delivery 2 did not come after wait(1)")
	}
	require.Equal(t, 2, <-asked)
	select {
	case got := <-second:
		require.FailNow(t, "delivery 3 came before wait(2)", "n=%d", got.n)
	case <-time.After(time.Second):
	}
	info := consumerInfo(t, b, topic, group)
	require.Equal(t, 1, info.NumAckPending, "held by the server for wait(2)")

	_, err := b.Subscriber(adapters.SubscriberSpec{Group: group, Ordered: true, InFlight: 1, RedeliveryWait: wait})
	adaptertest.RequireRefused(t, err, "RedeliveryWait", "an ordered spec with a wait")
}

// A ConcurrentSubscriber and a ConcurrentRedeliverySubscriber hand out many
// messages of the group at once and settle each on its own.
func TestConcurrentSubscribersManyInFlight(t *testing.T) {
	t.Parallel()
	b := openBroker(t, sharedURL(), func(c *Config) { c.Consumer.NakDelay = 100 * time.Millisecond })
	adaptertest.ConcurrentFlight(t, b, time.Minute)
}

// Every header JetStream or this adapter adds to a delivery is one the
// Rules refuse (every Nats-* header), so a replay leaves it out and Publish
// never sends it; a redelivery after a nak, with or without a delay, adds
// none.
func TestDeliveryHeadersAreRefusedByTheRules(t *testing.T) {
	t.Parallel()
	b := openBroker(t, sharedURL(), func(c *Config) { c.Consumer.NakDelay = 50 * time.Millisecond })
	added := adaptertest.DeliveryHeaders(t, b, time.Minute)
	t.Logf("added on delivery: %v", added)
}
