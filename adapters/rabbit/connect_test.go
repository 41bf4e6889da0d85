package rabbit

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
)

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
