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
	"github.com/millrace-io/millrace/middleware/consumer"
)

// With prefetch 1 a nacked message comes back before any later one: a
// queue with one subscription keeps its order across redeliveries.
func TestOrderAcrossNack(t *testing.T) {
	t.Parallel()
	b := openBroker(t, testConfig(serverURL()))
	topic, group := provisioned(t, b, "order")
	var msgs []*message.Message
	for i := range 10 {
		msgs = append(msgs, newMsg(fmt.Sprint(i)))
	}
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)))
	ch := adaptertest.Subscribe(t, b, topic, group)

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
	ch := adaptertest.Subscribe(t, b, topic, group)
	first := newMsg(`"first"`)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, first)))
	m := adaptertest.Next(t, ch, 30*time.Second)
	require.Equal(t, first.UUID, m.UUID)
	m.Ack()

	raw := rawChannel(t, cfg.URL)
	_, err := raw.QueueDelete(QueueName(topic, group), false, false, false)
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

// An ordered handler on one quorum queue with 16 workers and 64 aggregates
// has many messages in flight from its one OrderedSubscriber, and every
// aggregate's events take effect once each, in order, across nacks (whose
// messages and every later one of their aggregates come back before newer
// ones), a lost connection (its in-flight acks fail, so duplicates come
// back; the inbox would drop them) and a stop and start of the consumer
// with messages in flight and held. The quorum queue's return of unacked
// messages to its head, in delivery order, is what this relies on. The
// throughput against the one-in-flight stock subscriber is logged.
func TestOrderedSubscriberManyInFlight(t *testing.T) {
	t.Parallel()
	b := openBroker(t, testConfig(serverURL()))
	topic, group := provisioned(t, b, "ordered")
	load := adaptertest.NewManyInFlight(t, b, topic)
	load.LostConnectionAndRestart(t, b,
		load.OrderedSubscriber(b, group),
		func(s message.Subscriber) {
			sub := s.(*subscriber)
			sub.mu.Lock()
			defer sub.mu.Unlock()
			require.NoError(t, sub.conn.Close())
		},
		// The stock subscriber: one message in flight, on another group.
		func(group string) consumer.Source {
			return consumer.Source{
				NewSubscriber: func() (message.Subscriber, error) { return b.Subscriber(adapters.SubscriberSpec{Group: group}) },
				Competing:     true,
			}
		})
}

// An Ordered spec with an InFlight that is no AMQP prefetch is refused.
func TestOrderedSubscriberInFlightRange(t *testing.T) {
	t.Parallel()
	b := openBroker(t, testConfig(serverURL()))
	adaptertest.RefusesOrderedInFlight(t, b, "rabbitmq: SubscriberSpec.InFlight: must ", 0, -1, 65536)
}
