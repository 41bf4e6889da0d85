package nats

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/nats/natsdev"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
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
				sub, err := br.Subscriber(group)
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
