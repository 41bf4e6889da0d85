package nats

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// An ordered handler on one stream with 16 workers and 64 aggregates has
// many messages in flight from its one OrderedSubscriber, and every
// aggregate's events take effect once each, in order, across nacks (after
// which the consumer is recreated from its ack floor), a lost connection
// (deliveries in flight are missed or their acks fail: the consumer is
// recreated, and duplicates come back, which the inbox would drop) and a
// stop and start of the consumer with messages in flight and held. The
// throughput against the one-in-flight stock subscriber on a consumer with
// max_ack_pending 1 is logged.
func TestOrderedSubscriberManyInFlight(t *testing.T) {
	t.Parallel()
	b := openBroker(t, sharedURL(), func(c *Config) { c.Consumer.NakDelay = 50 * time.Millisecond })
	topic, group := orderedGroup(t, b, "ordered")
	load := adaptertest.NewManyInFlight(t, b, topic)
	load.LostConnectionAndRestart(t, b,
		load.OrderedSubscriber(b, group),
		func(s message.Subscriber) {
			sub := s.(*orderedSubscriber)
			sub.mu.Lock()
			nc := sub.subs[0].conn()
			sub.mu.Unlock()
			require.NotNil(t, nc, "the subscription consumes")
			require.NoError(t, nc.ForceReconnect())
		},
		func(group string) consumer.Source {
			// The stock subscriber on a consumer with max_ack_pending 1.
			require.NoError(t, b.ProvisionGroup(context.Background(), topic, adapters.GroupSpec{Name: group, Start: adapters.StartAll, Ordered: true}))
			return consumer.Source{
				NewSubscriber: func() (message.Subscriber, error) { return b.Subscriber(adapters.SubscriberSpec{Group: group}) },
				Competing:     true,
			}
		})
	require.Equal(t, load.Prefetch(), consumerInfo(t, b, topic, group).Config.MaxAckPending, "the ordered subscriber's consumer")
}

// One process at a time consumes an ordered group. A second one waits while
// the first renews its lease; when the first stops renewing (cut off, or
// dead) without acking what it held, the second takes the group over after
// lease_ttl and gets the unacked message again before every newer one, and
// nothing it did ack. A stop gives the lease up at once.
func TestOrderedGroupIsTakenOverInOrder(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		ctx := context.Background()
		const ttl = 2 * time.Second
		short := func(c *Config) { c.Consumer.LeaseTTL = ttl }
		first, second := openBroker(t, url, short), openBroker(t, url, short)
		topic, group := adaptertest.Name("takeover"), adaptertest.Name("g")
		var msgs []*message.Message
		for _, id := range []string{"m0", "m1", "m2", "m3"} {
			m := newMsg(id)
			m.Metadata.Set(envelope.AggregateIDKey, "a")
			msgs = append(msgs, m)
		}
		require.NoError(t, first.ProvisionGroup(ctx, topic, adapters.GroupSpec{Name: group, Start: adapters.StartAll, Ordered: true}))
		require.NoError(t, first.PublishBatch(ctx, adaptertest.Outgoing(topic, msgs[:3]...)))

		s1, err := first.Subscriber(adapters.SubscriberSpec{Group: group, Ordered: true, InFlight: 8})
		require.NoError(t, err)
		ch1, err := s1.Subscribe(ctx, topic)
		require.NoError(t, err)
		m0 := adaptertest.Next(t, ch1, time.Minute)
		require.Equal(t, "m0", m0.UUID)
		m0.Ack()
		m1 := adaptertest.Next(t, ch1, time.Minute)
		require.Equal(t, "m1", m1.UUID) // never settled: held as by a crashed process

		s2, err := second.Subscriber(adapters.SubscriberSpec{Group: group, Ordered: true, InFlight: 8})
		require.NoError(t, err)
		ch2, err := s2.Subscribe(ctx, topic)
		require.NoError(t, err)
		select {
		case m := <-ch2:
			t.Fatalf("the second process got %s while the first held the lease", m.UUID)
		case <-time.After(3 * ttl / 2): // longer than a ttl: the first renews it
		}

		// The first is cut off from the server: it can renew nothing.
		cutAt := time.Now()
		first.nc.Close()
		require.NoError(t, second.PublishBatch(ctx, adaptertest.Outgoing(topic, msgs[3])))
		var got []string
		for range 3 {
			m := adaptertest.Next(t, ch2, time.Minute)
			got = append(got, m.UUID)
			m.Ack()
		}
		t.Logf("taken over %s after the holder's last chance to renew (lease_ttl %s)", time.Since(cutAt).Round(time.Millisecond), ttl)
		require.Equal(t, []string{"m1", "m2", "m3"}, got, "the unacked m1 first, the acked m0 not again")

		// A stop gives the lease up: a third process takes over at once.
		require.NoError(t, s2.Close())
		third := openBroker(t, url, func(c *Config) { c.Consumer.LeaseTTL = time.Hour })
		s3, err := third.Subscriber(adapters.SubscriberSpec{Group: group, Ordered: true, InFlight: 8})
		require.NoError(t, err)
		defer s3.Close()
		ch3, err := s3.Subscribe(ctx, topic)
		require.NoError(t, err)
		require.NoError(t, third.PublishBatch(ctx, adaptertest.Outgoing(topic, newMsg("m4"))))
		require.Equal(t, "m4", adaptertest.Next(t, ch3, time.Minute).UUID, "given up by a stop: taken without waiting an hour's ttl")
		require.NoError(t, s1.Close())
		require.NoError(t, s3.Close())

		// Deprovision takes the group's lease with the stream.
		kv, err := third.leases(ctx)
		require.NoError(t, err)
		_, err = kv.Get(ctx, leaseKey(topic, group))
		require.NoError(t, err, "the lease is kept while the stream is")
		require.NoError(t, third.Deprovision(ctx, topic, group))
		_, err = kv.Get(ctx, leaseKey(topic, group))
		require.ErrorIs(t, err, jetstream.ErrKeyNotFound)
	})
}

// An Ordered spec with an InFlight that is no max_ack_pending is refused.
func TestOrderedSubscriberInFlightRange(t *testing.T) {
	t.Parallel()
	adaptertest.RefusesOrderedInFlight(t, openBroker(t, sharedURL(), nil),
		"nats: SubscriberSpec.InFlight: must be at least 1 for an ordered subscription; got 0", 0)
}

// A process whose handler is not ordered finds the group's consumer at
// max_ack_pending 1 and says so, rather than raising it under an ordered
// handler of another process.
func TestUnorderedProvisionOfOrderedGroupConflicts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := sharedURL()
	topic, group := adaptertest.Name("wasordered"), adaptertest.Name("g")
	require.NoError(t, openBroker(t, url, nil).ProvisionGroup(ctx, topic, adapters.GroupSpec{Name: group, Start: adapters.StartAll, Ordered: true}))
	b := openBroker(t, url, nil)
	err := b.Provision(ctx, topic, group)
	require.ErrorIs(t, err, adapters.ErrTopologyConflict)
	require.True(t, adapters.IsPermanent(err))
	require.ErrorContains(t, err, "max_ack_pending is 1 on the server, 32 wanted (broker.nats.consumer.max_ack_pending; a handler with consumer.ordered: true has its consumer.prefetch)")
	require.Equal(t, 1, consumerInfo(t, b, topic, group).Config.MaxAckPending, "left as it was")
}

// The floor a lease keeps is that of its stream: a stream deleted by hand
// and made again (with the lease left behind) is read from its start, not
// from the old stream's floor, which would skip its first messages.
func TestOrderedSubscriberIgnoresTheFloorOfAnOlderStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := openBroker(t, sharedURL(), nil)
	topic, group := adaptertest.Name("remade"), adaptertest.Name("g")
	t.Cleanup(func() { _ = b.forgetLeases(context.Background(), topic, []string{group}) })
	kv, err := b.leases(ctx)
	require.NoError(t, err)
	floor := func() string {
		e, err := kv.Get(ctx, leaseKey(topic, group))
		if err != nil {
			return err.Error()
		}
		return string(e.Value())
	}
	consume := func(until func() bool, want ...string) {
		t.Helper()
		s, err := b.Subscriber(adapters.SubscriberSpec{Group: group, Ordered: true, InFlight: 4})
		require.NoError(t, err)
		ch, err := s.Subscribe(ctx, topic)
		require.NoError(t, err)
		for _, id := range want {
			m := adaptertest.Next(t, ch, time.Minute)
			require.Equal(t, id, m.UUID)
			m.Ack()
		}
		require.Eventually(t, until, 10*time.Second, 10*time.Millisecond)
		require.NoError(t, s.Close())
	}
	always := func() bool { return true }
	require.NoError(t, b.ProvisionGroup(ctx, topic, adapters.GroupSpec{Name: group, Start: adapters.StartAll, Ordered: true}))
	require.NoError(t, b.PublishBatch(ctx, adaptertest.Outgoing(topic, newMsg("m0"), newMsg("m1"), newMsg("m2"))))
	consume(always, "m0", "m1", "m2")
	// Taking the lease again records the consumer's floor, 3, in it.
	consume(func() bool { return strings.Contains(floor(), `"floor":3,`) })

	require.NoError(t, b.js.DeleteStream(ctx, StreamName(topic)))
	b.forgetStream(topic)
	require.NoError(t, b.PublishBatch(ctx, adaptertest.Outgoing(topic, newMsg("n0"), newMsg("n1"))))
	consume(always, "n0", "n1")
}

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
