package nats

import (
	"context"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
)

// openWithin runs Open and fails the test if it has not returned after a
// generous bound (a hang, not a slow machine).
func openWithin(t *testing.T, cfg Config, connectTimeout time.Duration) error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		b, err := Open(context.Background(), cfg, adapters.Options{ConnectTimeout: connectTimeout})
		if b != nil {
			_ = b.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(60 * time.Second):
		require.FailNow(t, "Open hangs")
		return nil
	}
}

func TestOpenUnreachableServer(t *testing.T) {
	t.Parallel()
	t.Run("Refused", func(t *testing.T) {
		t.Parallel()
		port := servers.FreePort(t)
		err := openWithin(t, Config{URL: fmt.Sprintf("nats://app:s3cret-pw@127.0.0.1:%d", port)}, 2*time.Second)
		require.ErrorContains(t, err, fmt.Sprintf("cannot connect to nats://app:xxxxx@127.0.0.1:%d: connection refused", port))
		require.NotContains(t, err.Error(), "within", "refused at once: no timeout elapsed")
		require.NotContains(t, err.Error(), "s3cret-pw")
	})
	t.Run("SilentListener", func(t *testing.T) {
		t.Parallel()
		// Accepts TCP connections and never says a word, as a wrong port or a
		// hung server does.
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Close() })
		go func() {
			var conns []net.Conn
			defer func() {
				for _, c := range conns {
					_ = c.Close()
				}
			}()
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				conns = append(conns, c)
			}
		}()
		url := "nats://app:s3cret-pw@" + l.Addr().String()
		err = openWithin(t, Config{URL: url}, 500*time.Millisecond)
		require.Error(t, err)
		require.ErrorContains(t, err, "cannot connect to nats://app:xxxxx@"+l.Addr().String()+": no answer within 500ms")
		require.NotContains(t, err.Error(), "refused")
		require.NotContains(t, err.Error(), "s3cret-pw")
	})
}

// A server without JetStream is refused at Open, with the reason.
func TestOpenWithoutJetStream(t *testing.T) {
	t.Parallel()
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, NoSigs: true, NoLog: true})
	require.NoError(t, err)
	srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	require.True(t, srv.ReadyForConnections(30*time.Second))
	err = openWithin(t, Config{URL: srv.ClientURL()}, 5*time.Second)
	require.ErrorContains(t, err, "JetStream is not enabled on "+srv.ClientURL())
}

func TestOpenInvalidConfig(t *testing.T) {
	t.Parallel()
	_, err := Open(context.Background(), Config{URL: "http://x", Consumer: ConsumerConfig{MaxAckPending: -1}}, adapters.Options{})
	require.ErrorContains(t, err, "broker.nats.url: URL scheme must be one of nats, tls")
	require.ErrorContains(t, err, "broker.nats.consumer.max_ack_pending: must be greater than 0; got -1")
}

// The server goes away mid-run: publishing fails with retryable errors, and
// works again once the server is back; nothing stored before is lost and
// the subscriber carries on.
func TestServerGoneMidRun(t *testing.T) {
	t.Parallel()
	proc := servers.StartNATS(t)
	b := openBroker(t, proc.URL, func(c *Config) { c.Publish.Timeout = 2 * time.Second })
	topic, group := provisioned(t, b, "gone")
	ch := adaptertest.Subscribe(t, b, topic, group)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("before"))))
	require.Equal(t, "before", adaptertest.Receive(t, ch, 1, time.Minute)[0].UUID)

	proc.Kill()
	batch := adaptertest.Outgoing(topic, newMsg("after-1"), newMsg("after-2"))
	err := b.PublishBatch(context.Background(), batch)
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	require.Equal(t, 0, be.FirstUnconfirmed())
	require.False(t, adapters.IsPermanent(err), "server gone is retryable: %v", err)
	perr := b.Publisher().Publish(topic, newMsg("after-3"))
	require.Error(t, perr)
	require.False(t, adapters.IsPermanent(perr), "%v", perr)

	proc.Start()
	deadline := time.Now().Add(60 * time.Second)
	for {
		err = b.PublishBatch(context.Background(), batch)
		if err == nil {
			break
		}
		require.False(t, adapters.IsPermanent(err), "%v", err)
		require.True(t, time.Now().Before(deadline), "publishing never worked again: %v", err)
		time.Sleep(100 * time.Millisecond)
	}
	require.NoError(t, b.Publisher().Publish(topic, newMsg("after-3")))
	// "before" may come again: its ack can be lost with the server.
	got := map[string]bool{}
	for len(got) < 3 {
		if m := adaptertest.Receive(t, ch, 1, time.Minute)[0]; m.UUID != "before" {
			got[m.UUID] = true
		}
	}
	require.Equal(t, map[string]bool{"after-1": true, "after-2": true, "after-3": true}, got)
	require.EqualValues(t, 4, streamMsgs(t, b, topic))
}

// A write blocked on a server cut off the network (the socket's buffer
// full, the connection's lock held, so pings cannot fire) is bounded like
// two unanswered pings and ends in a reconnect; nats.go's own default waits
// a minute and then keeps the dead connection (the NATS partition scenario
// of internal/testing/faults showed a relay stalled so for over two minutes).
func TestBlockedWriteIsBounded(t *testing.T) {
	t.Parallel()
	b := openBroker(t, sharedURL(), func(c *Config) { c.PingInterval = 3 * time.Second })
	require.Equal(t, 6*time.Second, b.nc.Opts.FlusherTimeout)
	require.True(t, b.nc.Opts.ReconnectOnFlusherError)
}

// Calls on a closed broker fail clearly; Close is idempotent.
func TestClosedBroker(t *testing.T) {
	t.Parallel()
	b, err := Open(context.Background(), Config{URL: servers.StartEmbeddedNATS(t).URL}, adapters.Options{})
	require.NoError(t, err)
	pub := b.Publisher()
	require.NoError(t, b.Close())
	require.NoError(t, b.Close())
	require.ErrorIs(t, b.PublishBatch(context.Background(), adaptertest.Outgoing("t", newMsg("x"))), errBrokerClosed)
	require.ErrorIs(t, pub.Publish("t", message.NewMessage("x", nil)), errPublisherClosed)
	_, err = b.Subscriber(adapters.SubscriberSpec{Group: "g"})
	require.ErrorIs(t, err, errBrokerClosed)

	b2 := openBroker(t, servers.StartEmbeddedNATS(t).URL, nil)
	sub, err := b2.Subscriber(adapters.SubscriberSpec{Group: "g"})
	require.NoError(t, err)
	require.NoError(t, sub.Close())
	require.NoError(t, sub.Close())
	_, err = sub.Subscribe(context.Background(), "t")
	require.ErrorIs(t, err, errSubscriberClosed)
}

// A server killed before it wrote the consumer's state to disk comes back
// with the consumer at the start of the stream. The messages the client
// still had queued from before are past the consumer's delivered position,
// and nats-server 2.10 and later never answer their acks. Each such ack
// waiting out its 5s must not hold up the messages behind it: every message
// arrives well within the wait, instead of after 32 × 5s.
func TestKilledServerLosingConsumerStateDoesNotStallDelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	proc := servers.StartNATS(t)
	b := openBroker(t, proc.URL, suiteConfig)
	topic, group := provisioned(t, b, "lostate")
	ch := adaptertest.Subscribe(t, b, topic, group)

	want := map[string]bool{}
	batch := func(round int) []adapters.Outgoing {
		var msgs []*message.Message
		for i := range 200 {
			m := newMsg(fmt.Sprintf("r%d-%d", round, i))
			want[m.UUID] = true
			msgs = append(msgs, m)
		}
		return adaptertest.Outgoing(topic, msgs...)
	}
	require.NoError(t, b.PublishBatch(ctx, batch(1)))
	for range 100 { // far past what the restarted consumer delivers first (max_ack_pending)
		m := adaptertest.Next(t, ch, time.Minute)
		delete(want, m.UUID)
		m.Ack()
	}
	// The client now holds up to max_ack_pending (32) delivered, unacked messages.
	require.Eventually(t, func() bool {
		return consumerInfo(t, b, topic, group).NumAckPending == defaultMaxAckPending
	}, 30*time.Second, 50*time.Millisecond)

	proc.Kill()
	removed := 0
	require.NoError(t, filepath.WalkDir(proc.StoreDir(), func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Name() == "o.dat" && filepath.Base(filepath.Dir(path)) == ConsumerName(group) {
			removed++
			return os.Remove(path) // the consumer's state, as a crash before its flush leaves it
		}
		return nil
	}))
	require.Equal(t, 1, removed, "the consumer's state file in the store")
	proc.Start()

	out := batch(2)
	require.Eventually(t, func() bool { return b.PublishBatch(ctx, out) == nil }, 60*time.Second, 200*time.Millisecond)
	// The contract's bound for messages after a restart; without the
	// acks beside the callback the 32 unanswered acks alone take 160s.
	deadline := time.After(60 * time.Second)
	for len(want) > 0 {
		select {
		case m := <-ch:
			delete(want, m.UUID) // redeliveries are allowed
			m.Ack()
		case <-deadline:
			require.FailNow(t, "delivery stalled", "%d messages never arrived after the restart", len(want))
		}
	}
	require.Eventually(t, func() bool {
		ci := consumerInfo(t, b, topic, group)
		return ci.NumAckPending == 0 && ci.NumPending == 0
	}, 30*time.Second, 100*time.Millisecond, "every message acked on the restarted server")
}

// broker.nats.embedded.enabled runs the server inside Open; Close stops it;
// the next Open on the same store directory finds the messages again.
func TestOpenWithEmbeddedServer(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cfg := Config{URL: "nats://127.0.0.1:0", Embedded: EmbeddedConfig{Enabled: true, StoreDir: dir}}
	b, err := Open(context.Background(), cfg, adapters.Options{})
	require.NoError(t, err)
	require.NotEqual(t, "nats://127.0.0.1:0", b.URL(), "the URL has the port picked")
	topic := adaptertest.Name("kept")
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("k1"), newMsg("k2"))))
	addr := strings.TrimPrefix(b.URL(), "nats://")
	require.NoError(t, b.Close())
	_, err = net.DialTimeout("tcp", addr, time.Second)
	require.Error(t, err, "Close stopped the embedded server")

	cfg.URL = "nats://" + addr // the same port, the same store
	b2 := openBroker(t, cfg.URL, func(c *Config) { c.Embedded = cfg.Embedded })
	require.EqualValues(t, 2, streamMsgs(t, b2, topic))
	require.Equal(t, []string{"k1", "k2"}, ids(adaptertest.Receive(t, adaptertest.Subscribe(t, b2, topic, "g"), 2, time.Minute)))
}

func ids(msgs []*message.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.UUID
	}
	return out
}

// A port already in use is a clear error, not a process exit.
func TestEmbeddedPortInUse(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	_, err = Open(context.Background(), Config{URL: "nats://" + l.Addr().String(), Embedded: EmbeddedConfig{Enabled: true, StoreDir: t.TempDir()}}, adapters.Options{})
	require.ErrorContains(t, err, fmt.Sprintf("embedded server cannot listen on %s", l.Addr()))
	require.ErrorContains(t, err, "address already in use")
}
