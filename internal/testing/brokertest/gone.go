package brokertest

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters/nats"
)

// RequireQueuesGone checks that none of queues exists on the RabbitMQ
// server at url: a passive declaration of each fails with NOT_FOUND.
func RequireQueuesGone(t *testing.T, url string, queues ...string) {
	t.Helper()
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	defer conn.Close()
	for _, q := range queues {
		ch, err := conn.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDeclarePassive(q, true, false, false, false, nil)
		var amqpErr *amqp.Error
		require.ErrorAs(t, err, &amqpErr, "queue %s is gone", q)
		require.Equal(t, amqp.NotFound, amqpErr.Code, "queue %s is gone", q)
	}
}

// RequireStreamsGone checks that the NATS server at url has no stream of
// any of topics.
func RequireStreamsGone(t *testing.T, url string, topics ...string) {
	t.Helper()
	js := NATSJetStream(t, url)
	for _, topic := range topics {
		_, err := js.Stream(context.Background(), nats.StreamName(topic))
		require.ErrorIs(t, err, jetstream.ErrStreamNotFound, "stream of %s is gone", topic)
	}
}
