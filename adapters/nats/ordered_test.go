package nats

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
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
	topic, group := adaptertest.Name("ordered"), adaptertest.Name("g")
	require.NoError(t, b.ProvisionGroup(context.Background(), topic, adapters.GroupSpec{Name: group, Start: adapters.StartAll, Ordered: true}))
	t.Cleanup(func() { _ = b.forgetLeases(context.Background(), topic, []string{group}) })
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
