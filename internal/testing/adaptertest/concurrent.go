package adaptertest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
)

// ConcurrentFlight checks b's unordered subscriptions that hand out many
// messages at once (Capabilities.ConcurrentFlight), with and, when b
// schedules redeliveries, without a RedeliveryWait of 100ms, each in a
// parallel subtest: one subscription with an InFlight of 8 hands out 8
// messages before any is settled and no 9th until one is; it takes their
// acks in any order; a nacked message comes again; every message is handed
// out; with a RedeliveryWait each message's delivery number is recorded
// while it is handed out (1, then 2 for the nacked one), and forgotten once
// it is settled. timeout bounds each wait (a nacked message comes back
// after the broker's redelivery delay).
func ConcurrentFlight(t *testing.T, b adapters.Broker, timeout time.Duration) {
	caps := b.Capabilities()
	require.True(t, caps.ConcurrentFlight, "%T has no Capabilities.ConcurrentFlight", b)
	t.Run("InFlight", func(t *testing.T) {
		t.Parallel()
		concurrentFlight(t, b, adapters.SubscriberSpec{}, timeout)
	})
	if !caps.ScheduledRedelivery {
		return
	}
	t.Run("InFlightRedeliveryWait", func(t *testing.T) {
		t.Parallel()
		concurrentFlight(t, b, adapters.SubscriberSpec{
			RedeliveryWait: func(int) time.Duration { return 100 * time.Millisecond },
			Deliveries:     &adapters.Deliveries{},
		}, timeout)
	})
}

func concurrentFlight(t *testing.T, b adapters.Broker, spec adapters.SubscriberSpec, timeout time.Duration) {
	ctx := context.Background()
	topic, group := Name("concurrent"), Name("g")
	require.NoError(t, b.Provision(ctx, topic, group))
	const inFlight, total = 8, 24
	msgs := make([]*message.Message, total)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("agg-%d", i), 1)
	}
	publishBatch(t, b, topic, msgs)

	spec.Group, spec.InFlight = group, inFlight
	sub, err := b.Subscriber(spec)
	require.NoError(t, err)
	numbered := func(m *message.Message, want int) {
		if spec.Deliveries == nil {
			return
		}
		n, ok := spec.Deliveries.Number(m)
		require.True(t, ok, "message %s has a delivery number", m.UUID)
		require.Equal(t, want, n, "delivery number of message %s", m.UUID)
	}
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	var first []*message.Message
	for range inFlight {
		first = append(first, Next(t, ch, timeout))
		numbered(first[len(first)-1], 1)
	}
	select {
	case m := <-ch:
		require.FailNow(t, "a message beyond inFlight was handed out before one was settled", "uuid %s", m.UUID)
	case <-time.After(500 * time.Millisecond):
	}
	nacked := first[0].UUID
	first[0].Nack()
	acked := map[string]int{}
	for i := len(first) - 1; i >= 1; i-- { // newest first: out of order
		first[i].Ack()
		acked[first[i].UUID]++
	}
	for len(acked) < total { // the nacked one included, once it came again
		m := Next(t, ch, timeout)
		if m.UUID == nacked {
			numbered(m, 2)
		} else {
			numbered(m, 1)
		}
		acked[m.UUID]++
		m.Ack()
	}
	if spec.Deliveries != nil {
		require.Eventually(t, func() bool {
			_, held := spec.Deliveries.Number(first[1])
			return !held
		}, timeout, 10*time.Millisecond, "a settled message's delivery number is forgotten")
	}
	require.Contains(t, acked, nacked, "the nacked message came again")
	for _, m := range msgs {
		require.Contains(t, acked, m.UUID, "never handed out")
	}
	require.Len(t, acked, total, "only the published messages")
	require.NoError(t, sub.Close())
}
