package nats

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/nats/natsdev"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	testservers "github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// benchServers are the servers the benchmarks compare: the embedded server
// with each fsync setting, and the shared server.
func benchServers(b *testing.B, bench func(b *testing.B, url string)) {
	for _, sync := range []string{SyncAlways, "2m"} {
		b.Run("embedded-sync-"+sync, func(b *testing.B) {
			srv, err := natsdev.Start("nats://127.0.0.1:0", natsdev.Options{StoreDir: b.TempDir(), Sync: sync})
			require.NoError(b, err)
			b.Cleanup(srv.Shutdown)
			bench(b, srv.URL())
		})
	}
	b.Run("shared", func(b *testing.B) { bench(b, sharedURL()) })
}

// BenchmarkPublishBatch publishes batches of 500 messages of 200 bytes, as
// the relay does.
func BenchmarkPublishBatch(b *testing.B) {
	benchServers(b, func(b *testing.B, url string) {
		br := openBroker(b, url, nil)
		topic := adaptertest.Name("bench")
		require.NoError(b, br.Provision(context.Background(), topic))
		const size = 500
		payload := make([]byte, 200)
		b.ResetTimer()
		for b.Loop() {
			batch := make([]adapters.Outgoing, size)
			for i := range batch {
				batch[i] = adapters.Outgoing{Topic: topic, Msg: message.NewMessage(adaptertest.Name("ev"), payload)}
			}
			require.NoError(b, br.PublishBatch(context.Background(), batch))
		}
		b.ReportMetric(float64(b.N*size)/b.Elapsed().Seconds(), "msgs/s")
	})
}

// BenchmarkPublishOneByOne is the Publisher path: one confirm per message.
func BenchmarkPublishOneByOne(b *testing.B) {
	benchServers(b, func(b *testing.B, url string) {
		br := openBroker(b, url, nil)
		topic := adaptertest.Name("bench")
		pub := br.Publisher()
		payload := make([]byte, 200)
		b.ResetTimer()
		for b.Loop() {
			require.NoError(b, pub.Publish(topic, message.NewMessage(adaptertest.Name("ev"), payload)))
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
	})
}

// BenchmarkConsume reads and acks 2000 messages per round through one
// subscriber, for several max_ack_pending and subscribers settings.
func BenchmarkConsume(b *testing.B) {
	for _, tc := range []struct{ maxAckPending, subscribers int }{{1, 1}, {32, 1}, {256, 1}, {32, 4}} {
		b.Run(fmt.Sprintf("max_ack_pending=%d/subscribers=%d", tc.maxAckPending, tc.subscribers), func(b *testing.B) {
			benchServers(b, func(b *testing.B, url string) {
				br := openBroker(b, url, func(c *Config) {
					c.Consumer.MaxAckPending = tc.maxAckPending
					c.Consumer.Subscribers = tc.subscribers
				})
				topic, group := adaptertest.Name("bench"), adaptertest.Name("g")
				sub, err := br.Subscriber(adapters.SubscriberSpec{Group: group})
				require.NoError(b, err)
				defer sub.Close()
				ch, err := sub.Subscribe(context.Background(), topic)
				require.NoError(b, err)
				const n = 2000
				b.ResetTimer()
				for b.Loop() {
					b.StopTimer()
					batch := make([]adapters.Outgoing, n)
					for i := range batch {
						batch[i] = adapters.Outgoing{Topic: topic, Msg: message.NewMessage(adaptertest.Name("ev"), []byte("x"))}
					}
					require.NoError(b, br.PublishBatch(context.Background(), batch))
					b.StartTimer()
					for range n {
						(<-ch).Ack()
					}
				}
				b.ReportMetric(float64(b.N*n)/b.Elapsed().Seconds(), "msgs/s")
			})
		})
	}
}

// BenchmarkOrderedConsume is an ordered handler's rate, in effects/s: 64
// aggregates of 10 events each, interleaved, a 2 ms handler, 16 workers,
// through the stock Subscriber on the max_ack_pending 1 consumer an ordered
// group is provisioned with (one in flight for the whole group) and through
// OrderedSubscriber (one per aggregate, up to the workers), on a private
// current nats-server (the version go.mod requires) and on the shared one.
// Each round consumes a topic and group of its own; publishing and
// stopping are not timed. -benchtime=1x gives one round of each.
func BenchmarkOrderedConsume(b *testing.B) {
	servers := map[string]func(b *testing.B) string{
		"current": func(b *testing.B) string { return testservers.StartNATS(b).URL },
		"shared":  func(b *testing.B) string { return sharedURL() },
	}
	for _, name := range []string{"current", "shared"} {
		for _, many := range []bool{false, true} {
			mode := map[bool]string{false: "one-in-flight", true: "many-in-flight"}[many]
			b.Run(name+"/"+mode, func(b *testing.B) { benchOrdered(b, servers[name](b), many) })
		}
	}
}

// benchOrdered is one of BenchmarkOrderedConsume's runs on the server at url.
func benchOrdered(b *testing.B, url string, many bool) {
	const aggregates, per, workers, prefetch = 64, 10, 16, 64
	const latency = 2 * time.Millisecond
	br := openBroker(b, url, nil)
	for b.Loop() {
		b.StopTimer()
		topic, group := orderedGroup(b, br, "obench")
		adaptertest.PublishOrdered(b, br, topic, aggregates, per)
		src := consumer.Source{NewSubscriber: func() (message.Subscriber, error) { return br.Subscriber(adapters.SubscriberSpec{Group: group}) }, Competing: true}
		if many {
			src.NewSubscriber = func() (message.Subscriber, error) {
				return br.Subscriber(adapters.SubscriberSpec{Group: group, Ordered: true, InFlight: prefetch})
			}
			src.Concurrent = true
		}
		l := adaptertest.NewOrderLedger()
		b.StartTimer()
		c := adaptertest.StartOrdered(b, topic, src, workers, prefetch, l, latency, 0)
		l.WaitHandled(b, aggregates*per)
		b.StopTimer()
		c.Stop(b)
		l.RequireComplete(b, aggregates, per, false)
		b.StartTimer()
	}
	b.ReportMetric(float64(b.N*aggregates*per)/b.Elapsed().Seconds(), "effects/s")
}
