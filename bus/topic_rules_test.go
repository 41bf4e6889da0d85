package bus_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
)

// A topic valid on one broker and not on another fails at NewTopic, naming
// the topic, the broker kind and its rule: a Topic is shared by services
// whatever their broker.
func TestNewTopicChecksEveryBrokersRules(t *testing.T) {
	t.Parallel()
	for topic, want := range map[string][]string{
		"shop.orders.": {`"shop.orders."`, "broker.kind nats", "not a valid NATS subject: empty token between dots"},
		"shop..orders": {`"shop..orders"`, "broker.kind nats", "empty token between dots"},
		// RabbitMQ names are at most 255 bytes, and a topic's queue adds a
		// prefix to it; Kafka takes 249 characters.
		strings.Repeat("t", 249): {"broker.kind rabbitmq", "RabbitMQ names are at most 255 bytes"},
	} {
		_, err := bus.NewTopic[placedV2](topic)
		require.Error(t, err, topic)
		for _, w := range want {
			require.ErrorContains(t, err, w, topic)
		}
		require.NotContains(t, err.Error(), "broker.kind kafka", "Kafka takes it")
	}
	for _, topic := range []string{"shop.orders", "shop-orders.v2", "a_b", strings.Repeat("t", 200)} {
		_, err := bus.NewTopic[placedV2](topic)
		require.NoError(t, err, topic)
	}
}
