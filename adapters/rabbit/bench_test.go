package rabbit

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

func benchMessages(n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		m := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order_id":"ord-%d","total_cents":4200}`, i))
		m.Metadata.Set(envelope.EventIDKey, m.UUID)
		m.Metadata.Set(envelope.AggregateIDKey, fmt.Sprintf("ord-%d", i%100))
		msgs[i] = m
	}
	return msgs
}

// BenchmarkPublishBatch is the relay's path: batches of 500 pipelined on
// one confirm-mode channel into a quorum queue.
func BenchmarkPublishBatch(b *testing.B) {
	broker := openBroker(b, testConfig(serverURL()))
	topic := adaptertest.Name("bench")
	require.NoError(b, broker.Provision(context.Background(), topic, "g"))
	msgs := benchMessages(b.N)
	b.ResetTimer()
	for start := 0; start < len(msgs); start += 500 {
		batch := make([]adapters.Outgoing, 0, 500)
		for _, m := range msgs[start:min(start+500, len(msgs))] {
			batch = append(batch, adapters.Outgoing{Topic: topic, Msg: m})
		}
		require.NoError(b, broker.PublishBatch(context.Background(), batch))
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msg/s")
}

// BenchmarkWatermillPublisher is the stock path for comparison:
// watermill-amqp's publisher with ConfirmDelivery, one message at a time
// (what Watermill's forwarder does), into the same kind of quorum queue.
func BenchmarkWatermillPublisher(b *testing.B) {
	url := serverURL()
	broker := openBroker(b, testConfig(url))
	topic := adaptertest.Name("bench")
	require.NoError(b, broker.Provision(context.Background(), topic, "g"))
	cfg := wamqp.NewDurablePubSubConfig(url, nil)
	cfg.Publish.ConfirmDelivery = true
	cfg.Publish.ChannelPoolSize = 1
	cfg.TopologyBuilder = noTopology{} // Provision declared it
	pub, err := wamqp.NewPublisher(cfg, watermill.NopLogger{})
	require.NoError(b, err)
	defer pub.Close()
	msgs := benchMessages(b.N)
	b.ResetTimer()
	for _, m := range msgs {
		require.NoError(b, pub.Publish(topic, m))
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msg/s")
}
