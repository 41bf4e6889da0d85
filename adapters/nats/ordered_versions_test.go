package nats

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// The ordered subscriber's design (a lease in a key-value bucket, the
// consumer recreated from its ack floor by each new holder) needs nothing
// newer than JetStream itself, so an ordered handler runs many aggregates
// at once on the shared server (2.9.10 here) and on a current one
// (NATS_CURRENT_URL, which make up sets up beside an older server, else a
// private one of the version go.mod requires, 2.15), in the same scenario: 8 workers, 64
// aggregates, a 2 ms handler that nacks every 97th event once; a competing
// process of the group waiting while the first consumes; the first cut off
// as by a SIGKILL (no ack, no renewal, no lease given up) a third of the
// way in, so the competitor takes over after lease_ttl; the competitor
// stopped and a restarted first process at two thirds. Every aggregate's
// events take effect once each (the ledger drops redeliveries as the inbox
// would) and in order, with more than one handler call under way at once.
func TestOrderedManyInFlightOnEachServerVersion(t *testing.T) {
	t.Parallel()
	t.Run("Current", func(t *testing.T) {
		t.Parallel()
		url := os.Getenv("NATS_CURRENT_URL") // make up's current server beside an older one
		if url == "" {
			url = servers.StartNATS(t).URL
		}
		orderedAcrossTakeovers(t, url)
	})
	t.Run("Shared", func(t *testing.T) {
		t.Parallel()
		orderedAcrossTakeovers(t, sharedURL())
	})
}

// orderedAcrossTakeovers is TestOrderedManyInFlightOnEachServerVersion on
// the server at url.
func orderedAcrossTakeovers(t *testing.T, url string) {
	const aggregates, per, workers, nackEvery = 64, 20, 8, 97
	const latency = 2 * time.Millisecond
	ctx := context.Background()
	short := func(c *Config) {
		c.Consumer.LeaseTTL = time.Second
		c.Consumer.NakDelay = 50 * time.Millisecond
	}
	first := openBroker(t, url, short)
	t.Logf("nats-server %s", first.nc.ConnectedServerVersion())
	topic, group := adaptertest.Name("orderedver"), adaptertest.Name("g")
	require.NoError(t, first.ProvisionGroup(ctx, topic, adapters.GroupSpec{Name: group, Start: adapters.StartAll, Ordered: true}))
	t.Cleanup(func() { _ = openBroker(t, url, nil).forgetLeases(context.Background(), topic, []string{group}) })
	adaptertest.PublishOrdered(t, first, topic, aggregates, per)
	events := aggregates * per

	l := adaptertest.NewOrderLedger()
	start := func(b *Broker) *adaptertest.OrderedConsumer {
		src := consumer.Source{
			NewSubscriber: func() (message.Subscriber, error) {
				return b.Subscriber(adapters.SubscriberSpec{Group: group, Ordered: true, InFlight: workers})
			},
			Competing: true, Concurrent: true,
		}
		return adaptertest.StartOrdered(t, topic, src, workers, workers, l, latency, nackEvery)
	}
	began := time.Now()
	a := start(first)
	aSub := (<-a.Subs).(*orderedSubscriber)
	l.WaitHandled(t, 1) // the first holds the lease before the second contends
	competitor := start(openBroker(t, url, short))
	<-competitor.Subs

	l.WaitHandled(t, events/3)
	cutAt := time.Now()
	first.nc.Close() // no renewal, no lease given up: taken over after lease_ttl
	aSub.mu.Lock()
	if nc := aSub.subs[0].conn(); nc != nil {
		nc.Close() // no ack of what it held
	}
	aSub.mu.Unlock()

	l.WaitHandled(t, events*2/3)
	t.Logf("the competitor took over and handled a third of the events %s after the cut", time.Since(cutAt).Round(time.Millisecond))
	a.Stop(t)
	competitor.Stop(t)
	restarted := start(openBroker(t, url, short))
	l.WaitHandled(t, events)
	elapsed := time.Since(began)
	restarted.Stop(t)

	dups, nacked := l.RequireComplete(t, aggregates, per, true)
	maxConcurrent := l.MaxConcurrent()
	t.Logf("%d events in %s (%.0f/s), %d nacks, %d duplicates dropped, at most %d handler calls at once (workers %d)",
		events, elapsed.Round(time.Millisecond), float64(events)/elapsed.Seconds(), nacked, dups, maxConcurrent, workers)
	require.Greater(t, maxConcurrent, 1, "many aggregates in flight at once")
}

// Why the ordered subscriber does not rest on JetStream's pinned-client
// priority groups (nats-server 2.11 and later) on a current server: when a
// pinned client stops pulling (a crash) and the pin moves after pinned_ttl,
// the server hands the new pin newer messages at once, while what the
// old pin held unacked stays pending until ack_wait (nats-server's
// unassignPinId leaves it there). With m0 of aggregate a held by the
// crashed pin, the new pin gets m1 of a first: an order violation, which
// recreating the consumer from its ack floor, under exclusive ownership,
// avoids; that ownership is what the lease gives, on every server version.
func TestPinnedGroupLetsNewerPassWhatTheOldPinHeld(t *testing.T) {
	t.Parallel()
	url := servers.StartNATS(t).URL
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	b := openBroker(t, url, nil)
	topic := adaptertest.Name("pinned")
	stream, err := b.js.CreateStream(ctx, jetstream.StreamConfig{Name: StreamName(topic), Subjects: []string{topic}})
	require.NoError(t, err)
	_, err = stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: "g", AckPolicy: jetstream.AckExplicitPolicy, AckWait: time.Minute, MaxAckPending: 8,
		PriorityPolicy: jetstream.PriorityPolicyPinned, PriorityGroups: []string{"pg"}, PinnedTTL: time.Second,
	})
	require.NoError(t, err)
	pull := func(b *Broker) jetstream.Msg {
		t.Helper()
		c, err := b.js.Consumer(ctx, StreamName(topic), "g")
		require.NoError(t, err)
		for ctx.Err() == nil {
			batch, err := c.Fetch(1, jetstream.FetchPriorityGroup("pg"), jetstream.FetchMaxWait(2*time.Second))
			if err != nil {
				continue // the pin is another client's, for now
			}
			for m := range batch.Messages() {
				return m
			}
		}
		require.FailNow(t, "nothing delivered")
		return nil
	}
	_, err = b.js.Publish(ctx, topic, []byte("m0"))
	require.NoError(t, err)
	held := pull(b) // the pinned client takes m0, then crashes: no ack
	require.Equal(t, "m0", string(held.Data()))
	_, err = b.js.Publish(ctx, topic, []byte("m1"))
	require.NoError(t, err)

	m := pull(openBroker(t, url, nil)) // the next pin, after pinned_ttl
	require.Equal(t, "m1", string(m.Data()), "the newer message of the aggregate passes the unacked m0")
	pin := func(m jetstream.Msg) string { return m.Headers().Get("Nats-Pin-Id") }
	require.NotEmpty(t, pin(m))
	require.NotEqual(t, pin(held), pin(m), "delivered to a new pin")
	info, err := stream.Consumer(ctx, "g")
	require.NoError(t, err)
	require.Equal(t, 2, info.CachedInfo().NumAckPending, "m0 waits for ack_wait")
}
