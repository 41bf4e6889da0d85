package rabbit

import (
	"context"
	"errors"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
)

// TestOutages stops, alarms and reconfigures a private RabbitMQ node, one
// case after the other.
func TestOutages(t *testing.T) {
	t.Parallel()
	// The dead-letter worker retries a dead letter it could not route after
	// this long (3 minutes by default).
	node := servers.StartRabbitMQ(t, "max_message_size = 1048576",
		"[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 1000}]}].\n")
	t.Run("AtLeastOnceDeadLettering", func(t *testing.T) { testAtLeastOnceDeadLettering(t, node) })
	t.Run("ServerMessageSizeLimit", func(t *testing.T) { testServerMessageSizeLimit(t, node) })
	t.Run("MemoryAlarmBlocksPublishers", func(t *testing.T) { testMemoryAlarm(t, node) })
	t.Run("BrokerDown", func(t *testing.T) { testBrokerDown(t, node) })
}

// nackUntilGone nacks every delivery of ch until none comes for a second,
// returning how many there were.
func nackUntilGone(t *testing.T, ch <-chan *message.Message) int {
	t.Helper()
	n := 0
	for {
		select {
		case m := <-ch:
			n++
			m.Nack()
		case <-time.After(time.Second):
			return n
		}
	}
}

// A dead letter whose dead-letter queue is missing stays with RabbitMQ
// (at-least-once dead-lettering) and reaches the queue once it is back. The
// same queue declared without x-overflow reject-publish loses it: RabbitMQ
// quietly falls back to at-most-once.
func testAtLeastOnceDeadLettering(t *testing.T, node *servers.RabbitMQ) {
	cfg := testConfig(node.URL)
	cfg.DeliveryLimit = 1
	b := openBroker(t, cfg)
	topic, group := provisioned(t, b, "alo")
	raw := rawChannel(t, node.URL)
	_, err := raw.QueueDelete(DeadLetterQueueName(topic, group), false, false, false)
	require.NoError(t, err)

	ch := adaptertest.Subscribe(t, b, topic, group)
	kept := newMsg(`"kept"`)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, kept)))
	require.Equal(t, cfg.DeliveryLimit+1, nackUntilGone(t, ch), "deliveries before dead-lettering")

	// Provision brings the dead-letter queue and its binding back.
	require.NoError(t, b.Provision(context.Background(), topic, group))
	d := getOne(t, raw, DeadLetterQueueName(topic, group), 60*time.Second)
	require.Equal(t, kept.UUID, d.MessageId)

	// The same arguments without x-overflow: the dead letter is dropped.
	plain := adaptertest.Name("amo")
	args := b.declarer.groupQueueArgs(topic, group)
	delete(args, amqp.QueueOverflowArg)
	_, err = raw.QueueDeclare(plain, true, false, false, false, args)
	require.NoError(t, err)
	_, err = raw.QueueDelete(DeadLetterQueueName(topic, group), false, false, false)
	require.NoError(t, err)
	require.NoError(t, raw.PublishWithContext(context.Background(), "", plain, false, false, amqp.Publishing{MessageId: "lost", Body: []byte("x")}))
	for i := 0; i <= cfg.DeliveryLimit; {
		d, ok, err := raw.Get(plain, false)
		require.NoError(t, err)
		if !ok {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		require.NoError(t, raw.Nack(d.DeliveryTag, false, true))
		i++
	}
	require.NoError(t, b.Provision(context.Background(), topic, group))
	time.Sleep(3 * time.Second) // three retry periods of the dead-letter worker
	_, ok, err := raw.Get(DeadLetterQueueName(topic, group), true)
	require.NoError(t, err)
	require.False(t, ok, "at-most-once: the dead letter is gone")
	_, ok, err = raw.Get(plain, true)
	require.NoError(t, err)
	require.False(t, ok)
}

// A body the adapter allows but the server refuses (max_message_size below
// max_message_bytes) closes the channel: that message fails permanently,
// naming the server's limit, the others are retryable, and the retry
// refuses it before sending so the rest goes through.
func testServerMessageSizeLimit(t *testing.T, node *servers.RabbitMQ) {
	cfg := testConfig(node.URL)
	cfg.MaxMessageBytes = DefaultMaxMessageBytes
	b := openBroker(t, cfg)
	topic, group := provisioned(t, b, "size")
	big := message.NewMessage(adaptertest.Name("ev"), make([]byte, 2<<20))
	batch := adaptertest.Outgoing(topic, newMsg(`"a"`), big, newMsg(`"b"`))

	err := b.PublishBatch(context.Background(), batch)
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	require.ErrorIs(t, be.Errs[1], adapters.ErrMessageTooLarge)
	require.True(t, adapters.IsPermanent(be.Errs[1]))
	require.Contains(t, be.Errs[1].Error(), "1048576")
	for _, i := range []int{0, 2} {
		if be.Errs[i] != nil {
			require.False(t, adapters.IsPermanent(be.Errs[i]), "%v", be.Errs[i])
		}
	}
	t.Log(be.Errs[1])

	err = b.PublishBatch(context.Background(), batch)
	require.ErrorAs(t, err, &be)
	require.Equal(t, 1, be.Failed(), "%v", err)
	require.ErrorIs(t, be.Errs[1], adapters.ErrMessageTooLarge)
	raw := rawChannel(t, node.URL)
	seen := map[string]bool{}
	for !seen[`"a"`] || !seen[`"b"`] { // "a" may be there twice: confirmed, then published again
		seen[string(getOne(t, raw, QueueName(topic, group), 10*time.Second).Body)] = true
	}
}

// While a memory alarm blocks publishers, PublishBatch returns a retryable
// error within its context instead of hanging (dropping the connection the
// broker stopped reading), a caller that comes while the broker says the
// connection is blocked is refused at once, subscribers (on their own
// connections) keep consuming, and a batch waiting out the alarm is
// confirmed once it clears.
func testMemoryAlarm(t *testing.T, node *servers.RabbitMQ) {
	b := openBroker(t, testConfig(node.URL))
	topic, group := provisioned(t, b, "alarm")
	before := newMsg(`"before"`)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, before)))

	node.MemoryAlarm(true)
	t.Cleanup(func() { node.MemoryAlarm(false) })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	err := b.PublishBatch(ctx, adaptertest.Outgoing(topic, newMsg(`"timed out"`)))
	cancel()
	require.Error(t, err, "nothing is confirmed during the alarm")
	require.False(t, adapters.IsPermanent(err), "an alarm is not permanent: %v", err)
	t.Log(err)
	require.Eventually(t, func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.conn.IsClosed() && b.blocked == ""
	}, 30*time.Second, 10*time.Millisecond, "the connection the broker stopped reading is dropped")

	// This batch waits the alarm out (or, when the broker's
	// connection.blocked came first, retries as the relay would).
	waiting := newMsg(`"waiting"`)
	waited := make(chan error, 1)
	go func() {
		deadline := time.Now().Add(2 * time.Minute)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			err := b.PublishBatch(ctx, adaptertest.Outgoing(topic, waiting))
			cancel()
			if err == nil || !errors.Is(err, ErrBlocked) || time.Now().After(deadline) {
				waited <- err
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	require.Eventually(t, func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.blocked != ""
	}, 30*time.Second, 10*time.Millisecond, "connection.blocked never arrived")
	ctx, cancel = context.WithTimeout(context.Background(), time.Minute)
	err = b.PublishBatch(ctx, adaptertest.Outgoing(topic, newMsg(`"refused"`)))
	cancel()
	require.ErrorIs(t, err, ErrBlocked)
	require.False(t, adapters.IsPermanent(err))
	t.Log(err)

	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	require.Equal(t, before.UUID, adaptertest.Receive(t, ch, 1, time.Minute)[0].UUID, "consuming goes on during the alarm")

	node.MemoryAlarm(false)
	require.NoError(t, <-waited, "the waiting batch is confirmed once the alarm clears")
	after := newMsg(`"after"`)
	publishEventually(t, b, topic, after)
	seen := map[string]bool{}
	for !seen[waiting.UUID] || !seen[after.UUID] {
		seen[adaptertest.Receive(t, ch, 1, time.Minute)[0].UUID] = true // messages published during the alarm may arrive too
	}
}

// publishEventually retries PublishBatch as the relay does until it succeeds.
func publishEventually(t *testing.T, b *Broker, topic string, msgs ...*message.Message) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := b.PublishBatch(ctx, adaptertest.Outgoing(topic, msgs...))
		cancel()
		if err == nil {
			return
		}
		require.False(t, adapters.IsPermanent(err), "%v", err)
		require.True(t, time.Now().Before(deadline), "never published: %v", err)
		time.Sleep(200 * time.Millisecond)
	}
}

// With the broker down, PublishBatch fails fast with a retryable error; once
// it is back, publishing reconnects and the subscription resumes by itself.
func testBrokerDown(t *testing.T, node *servers.RabbitMQ) {
	b := openBroker(t, testConfig(node.URL))
	topic, group := provisioned(t, b, "down")
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("1"))))
	adaptertest.Receive(t, ch, 1, time.Minute)

	node.Stop()
	for range 2 {
		began := time.Now()
		err := b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("lost?")))
		var be *adapters.BatchError
		require.ErrorAs(t, err, &be)
		require.False(t, adapters.IsPermanent(err), "%v", err)
		require.Less(t, time.Since(began), 30*time.Second)
		t.Log(err)
	}

	node.Start()
	back := newMsg(`"back"`)
	publishEventually(t, b, topic, back)
	seen := map[string]bool{}
	for !seen[back.UUID] {
		seen[adaptertest.Receive(t, ch, 1, time.Minute)[0].UUID] = true
	}
}

// Nothing listens on the port: Open fails at once, naming the address and
// not the password.
func TestOpenRefused(t *testing.T) {
	t.Parallel()
	port := servers.FreePort(t)
	url := "amqp://millrace:s3cret-pw@127.0.0.1:" + strconv.Itoa(port) + "/"
	_, err := Open(context.Background(), Config{URL: url}, adapters.Options{ConnectTimeout: 5 * time.Second})
	require.Error(t, err)
	require.Contains(t, err.Error(), "127.0.0.1:"+strconv.Itoa(port))
	require.NotContains(t, err.Error(), "s3cret-pw")
	t.Log(err)
}

// A server that accepts TCP but never speaks AMQP: Open gives up after
// ConnectTimeout instead of hanging, and so does a context that ends first.
func TestOpenSilentServer(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	url := "amqp://millrace:s3cret-pw@" + l.Addr().String() + "/"

	began := time.Now()
	_, err = Open(context.Background(), Config{URL: url}, adapters.Options{ConnectTimeout: 500 * time.Millisecond})
	require.Error(t, err)
	require.Less(t, time.Since(began), 30*time.Second, "bounded by the connect timeout, not hanging")
	require.Contains(t, err.Error(), l.Addr().String())
	require.NotContains(t, err.Error(), "s3cret-pw")
	t.Log(err)

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = Open(ctx, Config{URL: url}, adapters.Options{ConnectTimeout: time.Hour})
	require.Error(t, err, "the context bounds Open too")
}

// Bad configuration is refused with the YAML path of every problem.
func TestOpenInvalidConfig(t *testing.T) {
	t.Parallel()
	_, err := Open(context.Background(), Config{URL: "http://u:pw@host/", Prefetch: -1}, adapters.Options{})
	require.Error(t, err)
	for _, want := range []string{"broker.rabbitmq.url", "broker.rabbitmq.prefetch"} {
		require.Contains(t, err.Error(), want)
	}
	require.NotContains(t, err.Error(), "pw@")
}

// Close is idempotent and every later call fails with adapters.ErrClosed.
func TestClose(t *testing.T) {
	t.Parallel()
	b, err := Open(context.Background(), testConfig(serverURL()), adapters.Options{})
	require.NoError(t, err)
	require.NoError(t, b.Close())
	require.NoError(t, b.Close())
	require.ErrorIs(t, b.Provision(context.Background(), adaptertest.Name("t")), adapters.ErrClosed)
	_, err = b.Subscriber(adapters.SubscriberSpec{Group: "g"})
	require.ErrorIs(t, err, adapters.ErrClosed)
	err = b.PublishBatch(context.Background(), adaptertest.Outgoing(adaptertest.Name("t"), newMsg("1")))
	require.ErrorIs(t, err, adapters.ErrClosed)
}
