package rabbit

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/middleware/consumer"
)

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
	topic, group := adaptertest.Name("ordered"), adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
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
