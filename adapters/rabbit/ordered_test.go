package rabbit

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/adaptertest"
	"github.com/millrace-io/millrace/middleware"
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
	src := middleware.Source{
		NewSubscriber: func() (message.Subscriber, error) { return b.OrderedSubscriber(group, load.Prefetch()) },
		Competing:     true,
		Concurrent:    true,
	}
	c := load.Start(t, src)
	sub := (<-c.Subs).(*subscriber)

	// A lost connection with messages in flight and held.
	load.Fault(t, load.Events()/3)
	sub.mu.Lock()
	require.NoError(t, sub.conn.Close())
	sub.mu.Unlock()

	// A stop of the consumer and a new one.
	load.Fault(t, 2*load.Events()/3)
	c.Stop(t)
	c = load.Start(t, src)
	// The stock subscriber: one message in flight, on another group.
	load.Finish(t, b, "a lost connection and a restart", func(group string) middleware.Source {
		return middleware.Source{
			NewSubscriber: func() (message.Subscriber, error) { return b.Subscriber(group) },
			Competing:     true,
		}
	}, c)
}

// OrderedSubscriber refuses an in-flight count that is no AMQP prefetch.
func TestOrderedSubscriberInFlightRange(t *testing.T) {
	t.Parallel()
	b := openBroker(t, testConfig(serverURL()))
	for _, n := range []int{0, -1, 65536} {
		_, err := b.OrderedSubscriber("g", n)
		require.ErrorContains(t, err, "inFlight must be 1 to 65535")
		require.True(t, adapters.IsPermanent(err))
	}
}
