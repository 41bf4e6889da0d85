package adaptertest

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
)

// DeliveryHeaders has a message with metadata of a user's delivered again
// the ways a message comes back to a consumer group of b: after a nack (the
// stock subscription) and, when b schedules redeliveries
// (Capabilities.ScheduledRedelivery), twice from its retry path, whose
// deliveries are the ones a handler poisons after its retries. Every
// metadata key that b or its broker added to those deliveries must be a
// header name b's Rules refuse: a replay keeps only the metadata Publish
// accepts, so that is how it leaves such a key out, and a user must not be
// able to publish a header the broker overwrites. The published metadata
// must arrive unchanged. It returns the added keys, sorted, for the
// caller to check against what its broker is known to add.
func DeliveryHeaders(t *testing.T, b adapters.Broker, timeout time.Duration) []string {
	t.Helper()
	ctx := context.Background()
	topic := Name("headers")
	nacked, scheduled := Name("nacked"), Name("scheduled")
	require.NoError(t, b.Provision(ctx, topic, nacked, scheduled))
	sent := event("agg-1", 1)
	sent.Metadata.Set("tenant", "acme")
	sent.Metadata.Set("x-request-source", "checkout") // a user's x- header: RabbitMQ's own are x- too
	var deliveries []*message.Message

	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: nacked})
	require.NoError(t, err)
	deliveries = append(deliveries, nackedOnce(t, sub, topic, sent, b, timeout)...)
	if sub := redeliverySubscriber(t, b, scheduled); sub != nil {
		deliveries = append(deliveries, nackedTwice(t, sub, topic, timeout)...)
	}

	added := map[string]bool{}
	for _, d := range deliveries {
		require.Equal(t, sent.UUID, d.UUID)
		for k, v := range d.Metadata {
			if want, ok := sent.Metadata[k]; ok {
				require.Equal(t, want, v, "metadata %s arrives as published", k)
				continue
			}
			added[k] = true
			probe := message.NewMessage(sent.UUID, nil)
			probe.Metadata.Set(k, v)
			var refused *adapters.RefusedError
			require.ErrorAs(t, b.Rules().CheckMessage(topic, probe), &refused,
				"the broker added header %s (%q) to a delivery, and its Rules let Publish send it", k, v)
			require.Equal(t, adapters.PartHeaderName, refused.Part, "header %s: %v", k, refused)
			require.Equal(t, k, refused.Key, "header %s: %v", k, refused)
		}
	}
	return slices.Sorted(maps.Keys(added))
}

// nackedOnce publishes sent to topic and returns the delivery that follows
// a nack of its first delivery from sub, acked; it closes sub.
func nackedOnce(t *testing.T, sub message.Subscriber, topic string, sent *message.Message, b adapters.Broker, timeout time.Duration) []*message.Message {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); _ = sub.Close() }()
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	publishBatch(t, b, topic, []*message.Message{sent})
	Next(t, ch, timeout).Nack()
	again := Next(t, ch, timeout)
	again.Ack()
	return []*message.Message{again}
}

// redeliverySubscriber returns a subscriber of group whose nacked messages
// wait at the broker for their next delivery, or nil when b has none.
func redeliverySubscriber(t *testing.T, b adapters.Broker, group string) message.Subscriber {
	t.Helper()
	if !b.Capabilities().ScheduledRedelivery {
		return nil
	}
	sub, err := b.Subscriber(adapters.SubscriberSpec{
		Group: group, InFlight: 1, RedeliveryWait: func(int) time.Duration { return 50 * time.Millisecond },
	})
	require.NoError(t, err)
	return sub
}

// nackedTwice returns the two deliveries from sub's retry path of the
// message on topic: its first delivery and the second are nacked, the third
// acked. It closes sub.
func nackedTwice(t *testing.T, sub message.Subscriber, topic string, timeout time.Duration) []*message.Message {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); _ = sub.Close() }()
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	Next(t, ch, timeout).Nack()
	second := Next(t, ch, timeout)
	second.Nack()
	third := Next(t, ch, timeout)
	third.Ack()
	return []*message.Message{second, third}
}
