package rabbit

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// With prefetch 1 a nacked message comes back before any later one: a
// queue with one subscription keeps its order across redeliveries.
func TestOrderAcrossNack(t *testing.T) {
	t.Parallel()
	b := openBroker(t, testConfig(serverURL()))
	topic, group := adaptertest.Name("order"), adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	var msgs []*message.Message
	for i := range 10 {
		msgs = append(msgs, newMsg(fmt.Sprint(i)))
	}
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)))
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	var got []string
	for len(got) < len(msgs) {
		m := adaptertest.Next(t, ch, 30*time.Second)
		if string(m.Payload) == "3" && m.Metadata.Get(DeliveryCountKey) == "" {
			m.Nack() // the first delivery of "3" fails once
			continue
		}
		got = append(got, string(m.Payload))
		m.Ack()
	}
	require.Equal(t, []string{"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"}, got)
}

// When its queue is deleted under it, the broker cancels the consumer: the
// subscription declares the queue again and goes on, and the handler never
// sees an empty message (watermill-amqp's subscriber hands one out).
func TestSubscriptionSurvivesQueueDeletion(t *testing.T) {
	t.Parallel()
	cfg := testConfig(serverURL())
	b := openBroker(t, cfg)
	topic, group := adaptertest.Name("deleted"), adaptertest.Name("g")
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	first := newMsg(`"first"`)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, first)))
	m := adaptertest.Next(t, ch, 30*time.Second)
	require.Equal(t, first.UUID, m.UUID)
	m.Ack()

	raw := rawChannel(t, cfg.URL)
	_, err = raw.QueueDelete(QueueName(topic, group), false, false, false)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		probe := rawChannel(t, cfg.URL)
		q, err := probe.QueueDeclarePassive(QueueName(topic, group), true, false, false, false, nil)
		return err == nil && q.Consumers == 1
	}, 30*time.Second, 100*time.Millisecond, "the subscription never declared its queue again")

	second := newMsg(`"second"`)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, second)))
	m = adaptertest.Next(t, ch, 30*time.Second)
	require.Equal(t, second.UUID, m.UUID, "no empty message in between")
	m.Ack()
}
