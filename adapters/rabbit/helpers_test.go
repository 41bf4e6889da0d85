package rabbit

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// defaultURL is the local RabbitMQ `make up` provides.
const defaultURL = "amqp://guest:guest@127.0.0.1:5672/"

// serverURL returns AMQP_URL, or the local server.
func serverURL() string {
	if u := os.Getenv("AMQP_URL"); u != "" {
		return u
	}
	return defaultURL
}

// testConfig is the configuration tests start from: the defaults, with a
// small message limit so the size test does not move 128 MiB around.
func testConfig(url string) Config {
	return Config{URL: url, MaxMessageBytes: 64 << 10}.WithDefaults()
}

// openBroker opens a Broker on cfg.URL for t. When t ends it is closed and
// every queue and exchange it declared is deleted, so the shared server does
// not fill up.
func openBroker(t testing.TB, cfg Config) *Broker {
	t.Helper()
	b, err := Open(context.Background(), cfg, adapters.Options{ConnectTimeout: 10 * time.Second})
	require.NoError(t, err)
	created := trackTopology(t, cfg.URL)
	b.declarer.observe = created
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	return b
}

// trackTopology returns a func to pass as declarer.observe; everything it is
// told about is deleted from the server at url when t ends (after cleanups
// registered later, such as closing the Broker, have run).
func trackTopology(t testing.TB, url string) func(kind, name string) {
	var mu sync.Mutex
	objects := map[[2]string]bool{}
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		if len(objects) == 0 {
			return
		}
		conn, err := amqp.Dial(url)
		if err != nil {
			t.Logf("cleanup: cannot connect to delete %d queues and exchanges: %v", len(objects), err)
			return
		}
		defer conn.Close()
		for _, kind := range []string{"queue", "exchange"} {
			for o := range objects {
				if o[0] != kind {
					continue
				}
				ch, err := conn.Channel()
				if err != nil {
					t.Logf("cleanup: %v", err)
					return
				}
				if kind == "queue" {
					_, err = ch.QueueDelete(o[1], false, false, false)
				} else {
					err = ch.ExchangeDelete(o[1], false, false)
				}
				if err != nil {
					t.Logf("cleanup: delete %s %q: %v", kind, o[1], err)
				}
				_ = ch.Close()
			}
		}
	})
	return func(kind, name string) {
		mu.Lock()
		objects[[2]string{kind, name}] = true
		mu.Unlock()
	}
}

// rawChannel opens a plain amqp091 channel on url, closed when t ends, for
// tests that look at or change the server behind the adapter's back.
func rawChannel(t testing.TB, url string) *amqp.Channel {
	t.Helper()
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	return ch
}

// getOne polls queue until a message is there or timeout passes.
func getOne(t testing.TB, ch *amqp.Channel, queue string, timeout time.Duration) amqp.Delivery {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		d, ok, err := ch.Get(queue, true)
		require.NoError(t, err)
		if ok {
			return d
		}
		require.True(t, time.Now().Before(deadline), "no message in queue %q after %s", queue, timeout)
		time.Sleep(50 * time.Millisecond)
	}
}

// provisioned returns a fresh topic named after prefix and a fresh group,
// both provisioned on b.
func provisioned(t testing.TB, b *Broker, prefix string) (topic, group string) {
	t.Helper()
	topic, group = adaptertest.Name(prefix), adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	return topic, group
}
