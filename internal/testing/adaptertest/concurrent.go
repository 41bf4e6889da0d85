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

// ConcurrentFlight checks b's unordered subscribers that hand out many
// messages at once, adapters.ConcurrentFlight's and
// adapters.ConcurrentRedelivery's (whose redeliveries wait 100ms), each in a
// parallel subtest: one subscription with an in-flight count of 8 hands out
// 8 messages before any is settled and no 9th until one is; it takes their
// acks in any order; a nacked message comes again; every message is handed
// out. timeout bounds each wait (a nacked message comes back after the
// broker's redelivery delay).
func ConcurrentFlight(t *testing.T, b adapters.Broker, timeout time.Duration) {
	cf, ok := b.(adapters.ConcurrentFlight)
	require.True(t, ok, "%T is not an adapters.ConcurrentFlight", b)
	cr, ok := b.(adapters.ConcurrentRedelivery)
	require.True(t, ok, "%T is not an adapters.ConcurrentRedelivery", b)
	t.Run("ConcurrentSubscriber", func(t *testing.T) {
		t.Parallel()
		concurrentFlight(t, b, cf.ConcurrentSubscriber, timeout)
	})
	t.Run("ConcurrentRedeliverySubscriber", func(t *testing.T) {
		t.Parallel()
		concurrentFlight(t, b, func(group string, inFlight int) (message.Subscriber, error) {
			return cr.ConcurrentRedeliverySubscriber(group, inFlight, func(int) time.Duration { return 100 * time.Millisecond })
		}, timeout)
	})
}

func concurrentFlight(t *testing.T, b adapters.Broker, newSubscriber func(group string, inFlight int) (message.Subscriber, error), timeout time.Duration) {
	ctx := context.Background()
	topic, group := Name("concurrent"), Name("g")
	require.NoError(t, b.Provision(ctx, topic, group))
	const inFlight, total = 8, 24
	msgs := make([]*message.Message, total)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("agg-%d", i), 1)
	}
	publishBatch(t, b, topic, msgs)

	sub, err := newSubscriber(group, inFlight)
	require.NoError(t, err)
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	var first []*message.Message
	for range inFlight {
		first = append(first, Next(t, ch, timeout))
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
		acked[m.UUID]++
		m.Ack()
	}
	require.Contains(t, acked, nacked, "the nacked message came again")
	for _, m := range msgs {
		require.Contains(t, acked, m.UUID, "never handed out")
	}
	require.Len(t, acked, total, "only the published messages")
	require.NoError(t, sub.Close())
}
