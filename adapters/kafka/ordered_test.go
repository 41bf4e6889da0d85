package kafka_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// An ordered handler on a topic of one partition with 16 workers and 64
// aggregates has many messages in flight from its one OrderedSubscriber,
// and every aggregate's events take effect once each, in order, across
// nacks (the nacked message comes back while the later ones of its
// aggregate wait), a rebalance (a second consumer of the group joins: the
// partition may move, and the old owner settles what it handed out before
// the new one starts, which the ledger checks: no aggregate ever has two
// messages in flight) and a stop of the first consumer with messages in
// flight and held (the other re-reads from the committed offset: acked
// messages beyond it come again as duplicates, which an inbox drops). The
// throughput against the stock subscriber, one message in flight per
// partition, is logged.
func TestOrderedSubscriberManyInFlight(t *testing.T) {
	t.Parallel()
	cfg := newEnv(t).config()
	cfg.Partitions = 1
	b := open(t, cfg)
	topic, group := adaptertest.Name("ordered"), adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	load := adaptertest.NewManyInFlight(t, b, topic)
	src := consumer.Source{
		NewSubscriber:  load.OrderedSubscriber(b, group),
		Competing:      true,
		KeyPartitioned: true,
		Concurrent:     true,
	}
	first := load.Start(t, src)

	// A second consumer of the group: a rebalance with messages in flight.
	load.Fault(t, load.Events()/3)
	second := load.Start(t, src)

	// The first one stops; the partition is the second's from then on.
	load.Fault(t, 2*load.Events()/3)
	first.Stop(t)
	// The stock subscriber: one message in flight per partition, on
	// another topic of one partition.
	load.Finish(t, b, "a rebalance and a stop", func(group string) consumer.Source {
		return consumer.Source{
			NewSubscriber:  func() (message.Subscriber, error) { return b.Subscriber(adapters.SubscriberSpec{Group: group}) },
			Competing:      true,
			KeyPartitioned: true,
		}
	}, second)
}

// An Ordered spec with an InFlight below 1 is refused.
func TestOrderedSubscriberInFlightRange(t *testing.T) {
	t.Parallel()
	b := open(t, newEnv(t).config())
	adaptertest.RefusesOrderedInFlight(t, b, "kafka: SubscriberSpec.InFlight: must ", 0, -1)
}
