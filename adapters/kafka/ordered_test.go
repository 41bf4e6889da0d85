package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/adaptertest"
	"github.com/millrace-io/millrace/middleware"
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
	const (
		aggregates = 64
		per        = 50
		workers    = 16
		prefetch   = 64
		latency    = 2 * time.Millisecond
	)
	cfg := newEnv(t).config()
	cfg.Partitions = 1
	b := open(t, cfg)
	topic, group := adaptertest.Name("ordered"), adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	adaptertest.PublishOrdered(t, b, topic, aggregates, per)
	n := aggregates * per

	l := adaptertest.NewOrderLedger()
	src := middleware.Source{
		NewSubscriber:  func() (message.Subscriber, error) { return b.OrderedSubscriber(group, prefetch) },
		Competing:      true,
		KeyPartitioned: true,
		Concurrent:     true,
	}
	start := time.Now()
	first := adaptertest.StartOrdered(t, topic, src, workers, prefetch, l, latency, 97)

	// A second consumer of the group: a rebalance with messages in flight.
	l.WaitHandled(t, n/3)
	steady := time.Since(start)
	second := adaptertest.StartOrdered(t, topic, src, workers, prefetch, l, latency, 97)

	// The first one stops; the partition is the second's from then on.
	l.WaitHandled(t, 2*n/3)
	first.Stop(t)
	l.WaitHandled(t, n)
	elapsed := time.Since(start)
	second.Stop(t)

	dups, nacked := l.RequireComplete(t, aggregates, per, true)
	manyRate := float64(n) / elapsed.Seconds()
	t.Logf("many in flight: %d events in %s (%.0f/s) with %d nacks, a rebalance and a stop; %d duplicates; the first third, before the rebalance: %.0f/s",
		n, elapsed.Round(time.Millisecond), manyRate, nacked, dups, float64(n/3)/steady.Seconds())

	// The stock subscriber: one message in flight per partition, on
	// another topic of one partition.
	oneRate := adaptertest.OneInFlightRate(t, b, func(group string) middleware.Source {
		return middleware.Source{
			NewSubscriber:  func() (message.Subscriber, error) { return b.Subscriber(group) },
			Competing:      true,
			KeyPartitioned: true,
		}
	}, aggregates, 5, workers, prefetch, latency)
	t.Logf("one in flight: %.0f events/s; many in flight (faults included): %.0f events/s, %.1fx", oneRate, manyRate, manyRate/oneRate)
}

// OrderedSubscriber refuses an in-flight count below 1.
func TestOrderedSubscriberInFlightRange(t *testing.T) {
	t.Parallel()
	b := open(t, newEnv(t).config())
	for _, n := range []int{0, -1} {
		_, err := b.OrderedSubscriber("g", n)
		require.ErrorContains(t, err, "inFlight must be at least 1")
		require.True(t, adapters.IsPermanent(err))
	}
}
