package kafka_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// A subscription with a RedeliveryWait parks a nacked message in the group's
// retry topic, a byte-for-byte copy with its next delivery number and due
// time in headers, and hands it out again once it is due, with the metadata
// it had; the number survives a new subscriber, and a parked message takes
// no in-flight slot while it waits.
func TestConcurrentRedeliverySubscriberParksInTheRetryTopic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := newEnv(t)
	cfg := env.config()
	cfg.RetryTopics = true
	b := open(t, cfg)
	require.True(t, b.Capabilities().ScheduledRedelivery)
	topic, group := adaptertest.Name("redeliver"), adaptertest.Name("g")
	require.NoError(t, b.Provision(ctx, topic, group))
	const firstWait = 300 * time.Millisecond
	wait, asked := adaptertest.ShortFirstWait(firstWait)
	msg := event("order-1", 1)
	msg.Metadata.Set("tenant", "acme")
	require.NoError(t, b.PublishBatch(ctx, adaptertest.Outgoing(topic, msg)))

	deliveries := &adapters.Deliveries{}
	redeliveries := func() (message.Subscriber, <-chan *message.Message) {
		sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group, InFlight: 1, RedeliveryWait: wait, Deliveries: deliveries})
		require.NoError(t, err)
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		return sub, ch
	}
	sub, ch := redeliveries()
	first := adaptertest.Next(t, ch, time.Minute)
	n, ok := deliveries.Number(first)
	require.True(t, ok, "no delivery number")
	require.Equal(t, 1, n)
	nacked := time.Now()
	first.Nack()
	require.Equal(t, 1, <-asked)

	second := adaptertest.Next(t, ch, time.Minute) // back from the retry topic once due
	require.GreaterOrEqual(t, time.Since(nacked), firstWait-10*time.Millisecond, "handed out before it was due")
	n, _ = deliveries.Number(second)
	require.Equal(t, 2, n)
	require.Equal(t, msg.UUID, second.UUID)
	require.Equal(t, string(msg.Payload), string(second.Payload))
	require.Equal(t, msg.Metadata, second.Metadata, "the retry headers are not metadata")
	require.NoError(t, sub.Close()) // delivery 2 is never settled: it is read again

	sub, ch = redeliveries()
	defer sub.Close()
	third := adaptertest.Next(t, ch, time.Minute)
	n, _ = deliveries.Number(third)
	require.Equal(t, 2, n, "the delivery cut short by the close is read again with its number")
	third.Nack()
	require.Equal(t, 2, <-asked)

	// Parked for an hour, it holds none of the one in-flight slot: a newer
	// message passes it.
	newer := event("order-2", 1)
	require.NoError(t, b.PublishBatch(ctx, adaptertest.Outgoing(topic, newer)))
	got := adaptertest.Next(t, ch, time.Minute)
	require.Equal(t, newer.UUID, got.UUID)
	got.Ack()

	checkParkedRecord(t, env, topic, group, msg)
	testkit.Eventually(t, time.Minute, "the parked message in the group's backlog", func() bool {
		backlog, err := b.Backlog(ctx, topic, group)
		require.NoError(t, err)
		parked := int64(0)
		for partition, n := range backlog {
			if strings.HasPrefix(partition, "retry-") {
				parked += n
			}
		}
		return parked == 1
	})

	checkRetryKeysReserved(t, b, topic, group)
}

// checkParkedRecord checks the last record of the group's retry topic: a
// copy of msg, parked for wait(2), for its third delivery.
func checkParkedRecord(t *testing.T, env *testEnv, topic, group string, msg *message.Message) {
	parked := lastRecord(t, env, kafka.RetryTopicName(topic, group))
	headers := map[string]string{}
	for _, h := range parked.Headers {
		headers[string(h.Key)] = string(h.Value)
	}
	require.Equal(t, "3", headers[kafka.RetryDeliveryKey])
	due, err := strconv.ParseInt(headers[kafka.RetryDueKey], 10, 64)
	require.NoError(t, err)
	require.InDelta(t, time.Now().Add(time.Hour).UnixMilli(), due, float64(time.Minute.Milliseconds()), "parked for wait(2)")
	require.Equal(t, string(msg.Payload), string(parked.Value))
	require.Equal(t, "order-1", string(parked.Key))
	require.Equal(t, "acme", headers["tenant"])
}

// checkRetryKeysReserved checks that a RedeliveryWait without InFlight is
// refused (retry topics work on the read-ahead subscription), and a
// message carrying a retry header.
func checkRetryKeysReserved(t *testing.T, b *kafka.Broker, topic, group string) {
	_, err := b.Subscriber(adapters.SubscriberSpec{Group: group, RedeliveryWait: func(int) time.Duration { return 0 }})
	adaptertest.RequireRefused(t, err, "InFlight", "a wait without InFlight")
	reserved := event("order-3", 1)
	reserved.Metadata.Set(kafka.RetryDeliveryKey, "1")
	var refused *adapters.RefusedError
	require.ErrorAs(t, b.Rules().CheckMessage(topic, reserved), &refused)
	require.Equal(t, kafka.RetryDeliveryKey, refused.Key)
}

// lastRecord is the last record of topic's partitions, read with a plain
// Sarama consumer.
func lastRecord(t *testing.T, env *testEnv, topic string) *sarama.ConsumerMessage {
	t.Helper()
	client, err := sarama.NewClient(env.brokers, sarama.NewConfig())
	require.NoError(t, err)
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	require.NoError(t, err)
	defer consumer.Close()
	partitions, err := client.Partitions(topic)
	require.NoError(t, err)
	var last *sarama.ConsumerMessage
	for _, p := range partitions {
		newest, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		if newest == 0 {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, newest-1)
		require.NoError(t, err)
		rec := <-pc.Messages()
		require.NoError(t, pc.Close())
		if last == nil || rec.Timestamp.After(last.Timestamp) {
			last = rec
		}
	}
	require.NotNil(t, last, "topic %s is empty", topic)
	return last
}

// A ConcurrentSubscriber and a ConcurrentRedeliverySubscriber (retry topics
// on) hand out many messages of the group at once and settle each on its
// own.
func TestConcurrentSubscribersManyInFlight(t *testing.T) {
	t.Parallel()
	cfg := newEnv(t).config()
	cfg.RetryTopics = true
	b := open(t, cfg)
	adaptertest.ConcurrentFlight(t, b, time.Minute)
}

// Every header Kafka or this adapter adds to a delivery is one the Rules
// refuse, so a replay leaves it out and Publish never sends it: a retry
// topic's records carry x-millrace-delivery and x-millrace-retry-due, which
// the subscriber takes out of the metadata; Kafka itself adds none.
func TestDeliveryHeadersAreRefusedByTheRules(t *testing.T) {
	t.Parallel()
	cfg := newEnv(t).config()
	cfg.RetryTopics = true
	b := open(t, cfg)
	require.True(t, b.Capabilities().ScheduledRedelivery)
	added := adaptertest.DeliveryHeaders(t, b, time.Minute)
	t.Logf("added on delivery: %v", added)
}
