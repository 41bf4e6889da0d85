package rabbit

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

func newMsg(payload string) *message.Message {
	return message.NewMessage(adaptertest.Name("ev"), []byte(payload))
}

// A classic queue where the configuration wants a quorum queue is a clear,
// permanent error naming the queue and the difference; the Broker keeps
// working afterwards although the broker closed the channel.
func TestProvisionConflictingQueue(t *testing.T) {
	t.Parallel()
	cfg := testConfig(serverURL())
	b := openBroker(t, cfg)
	topic, group := adaptertest.Name("conflict"), adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic)) // the topic's own objects are fine

	raw := rawChannel(t, cfg.URL)
	b.declarer.observe("queue", QueueName(topic, group))
	_, err := raw.QueueDeclare(QueueName(topic, group), true, false, false, false, nil) // classic
	require.NoError(t, err)

	err = b.Provision(context.Background(), topic, group)
	require.Error(t, err)
	require.ErrorIs(t, err, adapters.ErrTopologyConflict)
	require.True(t, adapters.IsPermanent(err), "a conflict is permanent: %v", err)
	for _, want := range []string{QueueName(topic, group), "x-queue-type", "quorum"} {
		require.Contains(t, err.Error(), want)
	}
	t.Log(err)

	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	defer sub.Close()
	_, err = sub.Subscribe(context.Background(), topic)
	require.ErrorIs(t, err, adapters.ErrTopologyConflict, "Subscribe reports the conflict too")

	// Still usable: another group provisions, publishing works.
	other := adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, other))
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg(`{}`))))
	d := getOne(t, raw, QueueName(topic, other), 10*time.Second)
	require.Equal(t, "{}", string(d.Body))
}

// A quorum queue declared with another delivery limit (the configuration
// changed) is a conflict naming the argument.
func TestProvisionChangedDeliveryLimit(t *testing.T) {
	t.Parallel()
	cfg := testConfig(serverURL())
	b := openBroker(t, cfg)
	topic, group := provisioned(t, b, "limit")
	require.NoError(t, b.Provision(context.Background(), topic, group), "idempotent")

	cfg.DeliveryLimit = 5
	changed := openBroker(t, cfg)
	err := changed.Provision(context.Background(), topic, group)
	require.ErrorIs(t, err, adapters.ErrTopologyConflict)
	require.Contains(t, err.Error(), "exists with other settings")
	require.Contains(t, err.Error(), "x-delivery-limit")
	t.Log(err)
}

// An exchange of another type fails that topic's messages permanently and
// leaves the rest of the batch alone.
func TestPublishBatchConflictingExchange(t *testing.T) {
	t.Parallel()
	cfg := testConfig(serverURL())
	b := openBroker(t, cfg)
	bad, good, group := adaptertest.Name("xconflict"), adaptertest.Name("ok"), adaptertest.Name("g")
	raw := rawChannel(t, cfg.URL)
	b.declarer.observe("exchange", bad)
	require.NoError(t, raw.ExchangeDeclare(bad, amqp.ExchangeTopic, true, false, false, false, nil))
	require.NoError(t, b.Provision(context.Background(), good, group))

	batch := append(adaptertest.Outgoing(good, newMsg(`1`)), adaptertest.Outgoing(bad, newMsg(`2`))...)
	batch = append(batch, adaptertest.Outgoing(good, newMsg(`3`))...)
	err := b.PublishBatch(context.Background(), batch)
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	require.NoError(t, be.Errs[0])
	require.ErrorIs(t, be.Errs[1], adapters.ErrTopologyConflict)
	require.True(t, adapters.IsPermanent(be.Errs[1]))
	require.Contains(t, be.Errs[1].Error(), "exchange "+`"`+bad+`"`)
	require.Contains(t, be.Errs[1].Error(), "type")
	require.NoError(t, be.Errs[2])
	require.Equal(t, "1", string(getOne(t, raw, QueueName(good, group), 10*time.Second).Body))
	require.Equal(t, "3", string(getOne(t, raw, QueueName(good, group), 10*time.Second).Body))
}

// A message published before any consumer group's queue exists is
// confirmed and parked in the topic's unrouted queue, never dropped.
func TestUnroutableMessagesAreParked(t *testing.T) {
	t.Parallel()
	cfg := testConfig(serverURL())
	b := openBroker(t, cfg)
	topic, group := adaptertest.Name("parked"), adaptertest.Name("g")
	raw := rawChannel(t, cfg.URL)

	early := newMsg(`"early"`)
	early.Metadata.Set("custom", "kept")
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, early)))
	d := getOne(t, raw, UnroutedQueueName(topic), 10*time.Second)
	require.Equal(t, early.UUID, d.MessageId)
	require.Equal(t, "kept", d.Headers["custom"])

	require.NoError(t, b.Provision(context.Background(), topic, group))
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg(`"late"`))))
	require.Equal(t, `"late"`, string(getOne(t, raw, QueueName(topic, group), 10*time.Second).Body))
	_, ok, err := raw.Get(UnroutedQueueName(topic), true)
	require.NoError(t, err)
	require.False(t, ok, "once a group queue is bound nothing is parked")
}

// With the parking queue gone, a message has nowhere to go: the mandatory
// publish comes back (basic.return) and is a retryable error, never a
// silent loss; the next call declares the topology again and succeeds.
func TestReturnedMessageIsRetryable(t *testing.T) {
	t.Parallel()
	cfg := testConfig(serverURL())
	b := openBroker(t, cfg)
	topic := adaptertest.Name("returned")
	require.NoError(t, b.Provision(context.Background(), topic))
	raw := rawChannel(t, cfg.URL)
	_, err := raw.QueueDelete(UnroutedQueueName(topic), false, false, false)
	require.NoError(t, err)

	first, second := newMsg(`1`), newMsg(`2`)
	err = b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, first, second))
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	require.Equal(t, 2, be.Failed())
	for _, e := range be.Errs {
		require.ErrorIs(t, e, ErrUnroutable)
		require.False(t, adapters.IsPermanent(e))
	}
	t.Log(be.Errs[0])

	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, first, second)), "the retry redeclares the parking queue")
	require.Equal(t, first.UUID, getOne(t, raw, UnroutedQueueName(topic), 10*time.Second).MessageId)
	require.Equal(t, second.UUID, getOne(t, raw, UnroutedQueueName(topic), 10*time.Second).MessageId)
}

// A message nacked more often than delivery_limit allows is dead-lettered
// into its group's dead-letter queue with RabbitMQ's x-death history; every
// redelivery before that reaches the handler with x-delivery-count.
func TestDeadLetterAfterDeliveryLimit(t *testing.T) {
	t.Parallel()
	cfg := testConfig(serverURL())
	cfg.DeliveryLimit = 2
	b := openBroker(t, cfg)
	topic, group := provisioned(t, b, "dlq")
	ch := adaptertest.Subscribe(t, b, topic, group)

	poison := newMsg(`"poison"`)
	poison.Metadata.Set("trace", "abc")
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, poison)))

	var counts []string
	for range cfg.DeliveryLimit + 1 {
		select {
		case m := <-ch:
			require.Equal(t, poison.UUID, m.UUID)
			require.Equal(t, "abc", m.Metadata.Get("trace"))
			counts = append(counts, m.Metadata.Get(DeliveryCountKey))
			m.Nack()
		case <-time.After(30 * time.Second):
			require.FailNow(t, "redelivery never arrived", "deliveries so far: %d", len(counts))
		}
	}
	require.Equal(t, []string{"", "1", "2"}, counts, "x-delivery-count of each delivery")

	raw := rawChannel(t, cfg.URL)
	d := getOne(t, raw, DeadLetterQueueName(topic, group), 30*time.Second)
	require.Equal(t, poison.UUID, d.MessageId)
	require.Equal(t, "delivery_limit", d.Headers["x-first-death-reason"])
	msg, err := Marshaler{}.Unmarshal(d)
	require.NoError(t, err)
	var deaths []map[string]any
	require.NoError(t, json.Unmarshal([]byte(msg.Metadata.Get(DeathKey)), &deaths), msg.Metadata.Get(DeathKey))
	require.Len(t, deaths, 1)
	require.Equal(t, QueueName(topic, group), deaths[0]["queue"])
	require.Equal(t, "delivery_limit", deaths[0]["reason"])
	quiet := time.After(time.Second)
	select {
	case m := <-ch:
		require.FailNow(t, "dead-lettered message delivered again", m.UUID)
	case <-quiet:
	}
}

// Bad names are refused before anything reaches the broker.
func TestBadNames(t *testing.T) {
	t.Parallel()
	b := openBroker(t, testConfig(serverURL()))
	long := strings.Repeat("x", 200)
	for _, c := range []struct {
		topic, group, want string
	}{
		{"with space", "g", "topic"},
		{"t", "a:b", "consumer group"},
		{long, long, "at most 255 bytes"},
	} {
		err := b.Provision(context.Background(), c.topic, c.group)
		require.Error(t, err, c)
		require.True(t, adapters.IsPermanent(err))
		require.Contains(t, err.Error(), c.want)
	}
	_, err := b.Subscriber(adapters.SubscriberSpec{Group: "bad group"})
	require.Error(t, err)
	err = b.PublishBatch(context.Background(), adaptertest.Outgoing("bad topic", newMsg(`1`)))
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	require.True(t, adapters.IsPermanent(be.Errs[0]))
	require.True(t, errors.Is(err, be.Errs[0]))
}

// Metadata too large for one AMQP frame would make the broker close the
// connection and fail everything in flight, on every retry: the message is
// refused, permanently, before it is sent, and the rest of the batch goes.
func TestPublishBatchHeadersTooLarge(t *testing.T) {
	t.Parallel()
	cfg := testConfig(serverURL())
	b := openBroker(t, cfg)
	topic, group := provisioned(t, b, "headers")
	big := newMsg(`"big"`)
	big.Metadata.Set("blob", strings.Repeat("v", 200_000))
	err := b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg(`"a"`), big, newMsg(`"b"`)))
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	require.Equal(t, 1, be.Failed())
	require.ErrorIs(t, be.Errs[1], adapters.ErrMessageTooLarge)
	require.True(t, adapters.IsPermanent(be.Errs[1]))
	require.Contains(t, be.Errs[1].Error(), "frame_max")
	t.Log(be.Errs[1])
	raw := rawChannel(t, cfg.URL)
	require.Equal(t, `"a"`, string(getOne(t, raw, QueueName(topic, group), 10*time.Second).Body))
	require.Equal(t, `"b"`, string(getOne(t, raw, QueueName(topic, group), 10*time.Second).Body))
}
