package nats

import (
	"context"
	"fmt"
	"net"
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
	topic, group := adaptertest.Name("gone"), adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
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
