package nats

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// sharedURL is the NATS server the tests share with everyone else: NATS_URL,
// or the local nats-server. Tests never restart it.
func sharedURL() string {
	if u := os.Getenv("NATS_URL"); u != "" {
		return u
	}
	return "nats://127.0.0.1:4222"
}

// openBroker opens a Broker on url with test-friendly settings changed by
// mutate; it closes with the test, and on the shared server the streams it
// touched are deleted when the top-level test ends.
func openBroker(t testing.TB, url string, mutate func(*Config)) *Broker {
	t.Helper()
	cfg := Config{URL: url}
	if mutate != nil {
		mutate(&cfg)
	}
	b, err := Open(context.Background(), cfg, adapters.Options{ConnectTimeout: 10 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() {
		registerStreams(b)
		require.NoError(t, b.Close())
	})
	return b
}

// Streams made on the shared server are deleted at the end of the test run
// (TestMain), not by each test: several tests' brokers share a topic.
var created = struct {
	sync.Mutex
	streams map[string]map[string]bool // URL -> stream names
}{streams: map[string]map[string]bool{}}

func registerStreams(b *Broker) {
	if b.embedded != nil {
		return
	}
	b.mu.Lock()
	var names []string
	for topic := range b.streams {
		names = append(names, StreamName(topic))
	}
	b.mu.Unlock()
	created.Lock()
	defer created.Unlock()
	if created.streams[b.url] == nil {
		created.streams[b.url] = map[string]bool{}
	}
	for _, n := range names {
		created.streams[b.url][n] = true
	}
}

// trackStream records a stream a test made without a Broker.
func trackStream(url, stream string) {
	created.Lock()
	defer created.Unlock()
	if created.streams[url] == nil {
		created.streams[url] = map[string]bool{}
	}
	created.streams[url][stream] = true
}

// deleteCreatedStreams deletes the streams the tests made on servers that
// are still up.
func deleteCreatedStreams() {
	created.Lock()
	defer created.Unlock()
	for url, streams := range created.streams {
		nc, err := nats.Connect(url, nats.Timeout(2*time.Second))
		if err != nil {
			continue // a private server that is gone already
		}
		js, err := jetstream.New(nc)
		if err == nil {
			for s := range streams {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				err := js.DeleteStream(ctx, s)
				cancel()
				if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
					fmt.Fprintf(os.Stderr, "cleanup: deleting stream %s on %s: %v\n", s, url, err)
				}
			}
		}
		nc.Close()
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

// orderedGroup returns a fresh topic named after prefix and a fresh ordered
// group on it, provisioned on b; the group's leases go with the test.
func orderedGroup(t testing.TB, b *Broker, prefix string) (topic, group string) {
	t.Helper()
	topic, group = adaptertest.Name(prefix), adaptertest.Name("g")
	require.NoError(t, b.ProvisionGroup(context.Background(), topic, adapters.GroupSpec{Name: group, Start: adapters.StartAll, Ordered: true}))
	t.Cleanup(func() { _ = b.forgetLeases(context.Background(), topic, []string{group}) })
	return topic, group
}

// subscribed subscribes a fresh group to a fresh topic named after prefix
// until the test ends.
func subscribed(t testing.TB, b *Broker, prefix string) (topic, group string, ch <-chan *message.Message) {
	t.Helper()
	topic, group = adaptertest.Name(prefix), adaptertest.Name("g")
	return topic, group, adaptertest.Subscribe(t, b, topic, group)
}
