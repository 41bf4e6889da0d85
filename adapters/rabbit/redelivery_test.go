package rabbit

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// A subscription with a RedeliveryWait parks a nacked message in the group's retry queue
// for wait(n) and RabbitMQ dead-letters it back; its delivery number counts
// the parkings and, from x-delivery-count, a delivery cut short by a closing
// subscriber, so a new subscriber goes on counting.
func TestRedeliverySubscriberParksInTheRetryQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := openBroker(t, testConfig(serverURL()))
	topic, group := provisioned(t, b, "redeliver")
	wait, asked := adaptertest.ShortFirstWait(200 * time.Millisecond)
	msg := newMsg("r1")
	msg.Metadata.Set("tenant", "acme")
	require.NoError(t, b.PublishBatch(ctx, adaptertest.Outgoing(topic, msg)))

	deliveries := &adapters.Deliveries{}
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group, RedeliveryWait: wait, Deliveries: deliveries})
	require.NoError(t, err)
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	first := adaptertest.Next(t, ch, 30*time.Second)
	n, ok := deliveries.Number(first)
	require.True(t, ok, "no delivery number")
	require.Equal(t, 1, n)
	first.Nack()
	require.Equal(t, 1, <-asked)

	second := adaptertest.Next(t, ch, 30*time.Second) // back from the retry queue after wait(1)
	n, _ = deliveries.Number(second)
	require.Equal(t, 2, n)
	require.Equal(t, msg.UUID, second.UUID)
	require.Equal(t, "r1", string(second.Payload))
	require.Equal(t, "acme", second.Metadata.Get("tenant"))
	require.NoError(t, sub.Close()) // delivery 2 is never settled: it is redelivered

	sub, err = b.Subscriber(adapters.SubscriberSpec{Group: group, RedeliveryWait: wait, Deliveries: deliveries})
	require.NoError(t, err)
	defer sub.Close()
	ch, err = sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	third := adaptertest.Next(t, ch, 30*time.Second)
	n, _ = deliveries.Number(third)
	require.Equal(t, 3, n, "the delivery cut short by the close counts")
	third.Nack()
	require.Equal(t, 3, <-asked)

	require.NoError(t, sub.Close()) // an unsettled delivery would go back to the group's queue
	raw := rawChannel(t, serverURL())
	parked := getOne(t, raw, RetryQueueName(topic, group), 30*time.Second)
	require.Equal(t, "3600000", parked.Expiration, "parked for wait(3)")
	require.EqualValues(t, 4, parked.Headers[DeliveryNumberKey])
	require.Equal(t, msg.UUID, parked.MessageId)
	q, err := raw.QueueDeclarePassive(QueueName(topic, group), true, false, false, false, nil)
	require.NoError(t, err)
	require.Zero(t, q.Messages, "acked on the group's queue once parked")

	_, err = b.Subscriber(adapters.SubscriberSpec{Group: group, InFlight: maxInFlight + 1, RedeliveryWait: wait})
	adaptertest.RequireRefused(t, err, "InFlight", "an in-flight count over an AMQP prefetch count")
}

// A message the retry queue cannot take (here the queue was deleted, so the
// broker returns the copy) is not acked: it is nacked and redelivered at
// once, and the redelivery counts.
func TestRedeliverySubscriberKeepsAMessageTheRetryQueueRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := openBroker(t, testConfig(serverURL()))
	topic, group := provisioned(t, b, "refused")
	msg := newMsg("r1")
	require.NoError(t, b.PublishBatch(ctx, adaptertest.Outgoing(topic, msg)))

	deliveries := &adapters.Deliveries{}
	sub, err := b.Subscriber(adapters.SubscriberSpec{
		Group: group, RedeliveryWait: func(int) time.Duration { return time.Hour }, Deliveries: deliveries,
	})
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	first := adaptertest.Next(t, ch, 30*time.Second)
	// Deleted once subscribed: subscribing declares it again.
	_, err = rawChannel(t, serverURL()).QueueDelete(RetryQueueName(topic, group), false, false, false)
	require.NoError(t, err)
	first.Nack()
	again := adaptertest.Next(t, ch, 30*time.Second) // an hour early: the park failed and the message was requeued
	n, _ := deliveries.Number(again)
	require.Equal(t, 2, n)
	require.Equal(t, msg.UUID, again.UUID)
	again.Ack()
}

// A ConcurrentSubscriber and a ConcurrentRedeliverySubscriber hand out many
// messages of the group at once and settle each on its own.
func TestConcurrentSubscribersManyInFlight(t *testing.T) {
	t.Parallel()
	b := openBroker(t, testConfig(serverURL()))
	adaptertest.ConcurrentFlight(t, b, time.Minute)
}

// Every header RabbitMQ or this adapter adds to a delivery is one the Rules
// refuse, so a replay leaves it out and Publish never sends it: the quorum
// queue's x-delivery-count on a redelivery, and on the retry queue's path
// the dead-lettering's x-death and x-first-death-* (x-last-death-* too from
// RabbitMQ 3.13) and the adapter's x-millrace-delivery.
func TestDeliveryHeadersAreRefusedByTheRules(t *testing.T) {
	t.Parallel()
	added := adaptertest.DeliveryHeaders(t, openBroker(t, testConfig(serverURL())), time.Minute)
	t.Logf("added on delivery: %v", added)
	for _, k := range []string{DeliveryCountKey, DeathKey, "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason", DeliveryNumberKey} {
		require.Contains(t, added, k)
	}
}
