package nats

import (
	"context"
	"fmt"
	"testing"
	"time"

	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
)

func consumerInfo(t *testing.T, b *Broker, topic, group string) *jetstream.ConsumerInfo {
	t.Helper()
	c, err := b.js.PushConsumer(context.Background(), StreamName(topic), ConsumerName(group))
	require.NoError(t, err)
	info, err := c.Info(context.Background())
	require.NoError(t, err)
	return info
}

// Watermill-nats gives up on a message after its ack timeout and returns
// from nats.go's callback; with ManualAck that is not an ack, so the server
// delivers the message again after ack_wait.
func TestUnackedMessageIsRedelivered(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, func(c *Config) { c.Consumer.AckWait = time.Second })
		topic, _, ch := subscribed(t, b, "noack")
		m := newMsg(adaptertest.Name("ev"))
		require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, m)))
		first := adaptertest.Next(t, ch, time.Minute)
		require.Equal(t, m.UUID, first.UUID)
		// Neither Ack nor Nack: the handler hangs past ack_wait.
		again := adaptertest.Next(t, ch, time.Minute)
		require.Equal(t, m.UUID, again.UUID, "delivered again, not lost")
		again.Ack()
	})
}

// The trap the subscriber avoids: watermill-nats without nats.ManualAck()
// lets nats.go ack the message when the callback returns on watermill's own
// ack timeout, although the handler never acked it. This test builds such a
// subscriber on a millrace consumer and shows the message acked and gone; if
// it ever fails, watermill-nats or nats.go changed and the comment in
// subscriber.go needs a look.
func TestTrapWatermillNATSAutoAcksWithoutManualAck(t *testing.T) {
	t.Parallel()
	url := servers.StartEmbeddedNATS(t).URL
	b := openBroker(t, url, nil)
	topic, group := provisioned(t, b, "trap")
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg(adaptertest.Name("ev")))))

	nc, err := nats.Connect(url)
	require.NoError(t, err)
	wm, err := wmnats.NewSubscriberWithNatsConn(nc, wmnats.SubscriberSubscriptionConfig{
		AckWaitTimeout:   200 * time.Millisecond,
		QueueGroupPrefix: ConsumerName(group),
		JetStream: wmnats.JetStreamConfig{
			SubscribeOptions: []nats.SubOpt{nats.AckExplicit()}, // no ManualAck
			DurablePrefix:    ConsumerName(group),
		},
	}, nil)
	require.NoError(t, err)
	ch, err := wm.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	m := adaptertest.Next(t, ch, time.Minute)
	_ = m // never acked
	deadline := time.Now().Add(30 * time.Second)
	for consumerInfo(t, b, topic, group).AckFloor.Stream < 1 {
		require.True(t, time.Now().Before(deadline), "the message was not auto-acked")
		time.Sleep(50 * time.Millisecond)
	}
	require.NoError(t, wm.Close())
	waitClosed(nc, 10*time.Second)
	info := consumerInfo(t, b, topic, group)
	require.Zero(t, info.NumAckPending, "nothing left to redeliver: the message is lost for the group")
	require.Zero(t, info.NumPending)
}

// Closing a subscriber acks nothing and keeps the group's durable consumer:
// the unacked message goes to the group's next subscriber.
func TestCloseNeverAcks(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, func(c *Config) { c.Consumer.AckWait = time.Second })
		topic, group := adaptertest.Name("close"), adaptertest.Name("g")
		m := newMsg(adaptertest.Name("ev"))
		require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, m)))

		sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
		require.NoError(t, err)
		ch, err := sub.Subscribe(context.Background(), topic)
		require.NoError(t, err)
		require.Equal(t, m.UUID, adaptertest.Next(t, ch, time.Minute).UUID)
		require.NoError(t, sub.Close())

		info := consumerInfo(t, b, topic, group) // still there
		require.Equal(t, 1, info.NumAckPending, "delivered, not acked")
		require.Zero(t, info.AckFloor.Stream)

		got := adaptertest.Receive(t, adaptertest.Subscribe(t, b, topic, group), 1, time.Minute)
		require.Equal(t, m.UUID, got[0].UUID)
	})
}

// One group on two topics is two consumers, one on each topic's stream, each
// with its own position (watermill-nats's DurablePrefix alone would name
// them alike).
func TestGroupHasAPositionPerTopic(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, nil)
		topicA, topicB, group := adaptertest.Name("orders.a"), adaptertest.Name("orders.b"), adaptertest.Name("billing")
		sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, sub.Close()) })
		chA, err := sub.Subscribe(context.Background(), topicA)
		require.NoError(t, err)
		chB, err := sub.Subscribe(context.Background(), topicB)
		require.NoError(t, err)

		require.NoError(t, b.PublishBatch(context.Background(), append(
			adaptertest.Outgoing(topicA, newMsg("a1"), newMsg("a2"), newMsg("a3")),
			adaptertest.Outgoing(topicB, newMsg("b1"))...)))
		for _, want := range []string{"a1", "a2", "a3"} {
			require.Equal(t, want, adaptertest.Receive(t, chA, 1, time.Minute)[0].UUID)
		}
		require.Equal(t, "b1", adaptertest.Receive(t, chB, 1, time.Minute)[0].UUID)
		require.EqualValues(t, 3, waitAcked(t, b, topicA, group, 3).AckFloor.Stream)
		require.EqualValues(t, 1, waitAcked(t, b, topicB, group, 1).AckFloor.Stream)
	})
}

func waitAcked(t *testing.T, b *Broker, topic, group string, seq uint64) *jetstream.ConsumerInfo {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		info := consumerInfo(t, b, topic, group)
		if info.AckFloor.Stream >= seq || time.Now().After(deadline) {
			return info
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A nacked message waits consumer.nak_delay instead of coming straight back.
func TestNackWaitsNakDelay(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, func(c *Config) { c.Consumer.NakDelay = time.Hour })
		topic, group, ch := subscribed(t, b, "nak")
		require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("n1"))))
		adaptertest.Next(t, ch, time.Minute).Nack()
		adaptertest.Quiet(t, ch, 2*time.Second) // a plain Nak would be back within milliseconds
		info := consumerInfo(t, b, topic, group)
		require.Equal(t, 1, info.NumAckPending, "held by the server until the delay ends")
	})
}

// Ordering: with max_ack_pending 1 a nacked message comes back before any
// later one; with more, later messages pass it.
func TestOrderAcrossNack(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		maxAckPending int
		want          []string
	}{
		{1, []string{"m0", "m1", "m2"}},
		{10, []string{"m1", "m2", "m0"}},
	} {
		t.Run(fmt.Sprint("max_ack_pending=", tc.maxAckPending), func(t *testing.T) {
			t.Parallel()
			eachServer(t, func(t *testing.T, url string) {
				b := openBroker(t, url, func(c *Config) {
					c.Consumer.MaxAckPending = tc.maxAckPending
					c.Consumer.NakDelay = 300 * time.Millisecond
				})
				topic, group := adaptertest.Name("order"), adaptertest.Name("g")
				require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("m0"), newMsg("m1"), newMsg("m2"))))
				ch := adaptertest.Subscribe(t, b, topic, group)
				first := adaptertest.Next(t, ch, time.Minute)
				require.Equal(t, "m0", first.UUID)
				first.Nack()
				var got []string
				for _, m := range adaptertest.Receive(t, ch, 3, time.Minute) {
					got = append(got, m.UUID)
				}
				require.Equal(t, tc.want, got)
			})
		})
	}
}

// consumer.subscribers is how many messages of a group one Subscribe call
// works on at once: each subscription holds one message until it is acked.
// The server hands each new message to a random subscription of the group,
// so with 30 messages published after subscribing every one of 3
// subscriptions has some (the chance that one has none is 3*(2/3)^30, about
// 1 in 66000). A backlog that exists before Subscribe goes to the first
// subscription up to max_ack_pending; see the README.
func TestSubscribersSetsConcurrency(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprint("subscribers=", n), func(t *testing.T) {
			t.Parallel()
			b := openBroker(t, servers.StartEmbeddedNATS(t).URL, func(c *Config) { c.Consumer.Subscribers = n })
			topic, _, ch := subscribed(t, b, "conc")
			const total = 30
			var msgs []*message.Message
			for i := range total {
				msgs = append(msgs, newMsg(fmt.Sprint("c", i)))
			}
			require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)))
			var held []*message.Message
			for range n {
				held = append(held, adaptertest.Next(t, ch, time.Minute)) // not acked
			}
			adaptertest.Quiet(t, ch, time.Second)
			for _, m := range held {
				m.Ack()
			}
			adaptertest.Receive(t, ch, total-n, time.Minute)
		})
	}
}

// Ending a Subscribe context while messages stream in is what makes a bare
// watermill-nats v2.1.3 subscriber send on its closed output channel (a data
// race in every one of several runs of this scenario, and a "send on closed
// channel" panic when the send wins); see subscription. Many rounds of it here: no race,
// no panic, and nothing is lost.
func TestCancelWhileMessagesArrive(t *testing.T) {
	t.Parallel()
	b := openBroker(t, servers.StartEmbeddedNATS(t).URL, func(c *Config) {
		c.Consumer.Subscribers = 4
		c.Consumer.NakDelay = 10 * time.Millisecond
		c.Consumer.AckWait = 2 * time.Second
	})
	topic, group := provisioned(t, b, "cancel")
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })

	const rounds, perRound = 40, 50
	acked := map[string]bool{}
	for r := range rounds {
		var batch []*message.Message
		for i := range perRound {
			batch = append(batch, newMsg(fmt.Sprintf("r%d-%d", r, i)))
		}
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		published := make(chan error, 1)
		go func() { published <- b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, batch...)) }()
		m := adaptertest.Next(t, ch, time.Minute)
		m.Ack()
		acked[m.UUID] = true
		cancel()
		for range ch { // closes soon; what is still handed out is left unacked
		}
		require.NoError(t, <-published)
	}
	ch := adaptertest.Subscribe(t, b, topic, group)
	total := rounds * perRound
	for len(acked) < total {
		m := adaptertest.Next(t, ch, time.Minute)
		acked[m.UUID] = true
		m.Ack()
	}
}

// A RedeliverySubscriber's messages carry their JetStream delivery count,
// also in a new subscriber after the first closed, and a nacked message
// waits wait(n) of the delivery n that was nacked, not consumer.nak_delay.
func TestRedeliverySubscriberNumbersDeliveries(t *testing.T) {
	t.Parallel()
	b := openBroker(t, sharedURL(), func(c *Config) { c.Consumer.NakDelay = time.Hour })
	topic, group := adaptertest.Name("redeliver"), adaptertest.Name("g")
	wait, asked := adaptertest.ShortFirstWait(10 * time.Millisecond)
	subscribe := func() (<-chan *struct{ n int }, func()) {
		deliveries := &adapters.Deliveries{}
		sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group, RedeliveryWait: wait, Deliveries: deliveries})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		out := make(chan *struct{ n int }, 1)
		go func() {
			for m := range ch {
				n, ok := deliveries.Number(m)
				require.True(t, ok, "no delivery number")
				m.Nack()
				out <- &struct{ n int }{n}
			}
		}()
		return out, func() { cancel(); require.NoError(t, sub.Close()) }
	}
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("r1"))))

	first, closeFirst := subscribe()
	require.Equal(t, 1, (<-first).n)
	require.Equal(t, 1, <-asked)
	closeFirst() // the nak of delivery 1 (10ms) is sent before Close returns

	second, closeSecond := subscribe()
	defer closeSecond()
	select {
	case got := <-second:
		require.Equal(t, 2, got.n, "the count survives a new subscriber")
	case <-time.After(30 * time.Second):
		require.FailNow(t, "delivery 2 did not come after wait(1)")
	}
	require.Equal(t, 2, <-asked)
	select {
	case got := <-second:
		require.FailNow(t, "delivery 3 came before wait(2)", "n=%d", got.n)
	case <-time.After(time.Second):
	}
	info := consumerInfo(t, b, topic, group)
	require.Equal(t, 1, info.NumAckPending, "held by the server for wait(2)")

	_, err := b.Subscriber(adapters.SubscriberSpec{Group: group, Ordered: true, InFlight: 1, RedeliveryWait: wait})
	adaptertest.RequireRefused(t, err, "RedeliveryWait", "an ordered spec with a wait")
}

// A ConcurrentSubscriber and a ConcurrentRedeliverySubscriber hand out many
// messages of the group at once and settle each on its own.
func TestConcurrentSubscribersManyInFlight(t *testing.T) {
	t.Parallel()
	b := openBroker(t, sharedURL(), func(c *Config) { c.Consumer.NakDelay = 100 * time.Millisecond })
	adaptertest.ConcurrentFlight(t, b, time.Minute)
}

// Every header JetStream or this adapter adds to a delivery is one the
// Rules refuse (every Nats-* header), so a replay leaves it out and Publish
// never sends it; a redelivery after a nak, with or without a delay, adds
// none.
func TestDeliveryHeadersAreRefusedByTheRules(t *testing.T) {
	t.Parallel()
	b := openBroker(t, sharedURL(), func(c *Config) { c.Consumer.NakDelay = 50 * time.Millisecond })
	added := adaptertest.DeliveryHeaders(t, b, time.Minute)
	t.Logf("added on delivery: %v", added)
}
