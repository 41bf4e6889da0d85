package kafka

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// A busy aggregate's backlog waits in its own partition's window and takes
// none of the subscription's in-flight slots: with the one message of a hot
// aggregate in flight and unacked and twenty more of it read behind it,
// another partition's aggregates still get the other slots.
func TestBusyAggregateLeavesTheSlotsToOtherPartitions(t *testing.T) {
	t.Parallel()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	require.NoError(t, err)
	t.Cleanup(cluster.Close)
	ctx := context.Background()
	b, err := Open(ctx, Config{Brokers: cluster.ListenAddrs(), Partitions: 2, ReplicationFactor: 1, MinInsyncReplicas: 1}, adapters.Options{ConnectTimeout: 30 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	require.NoError(t, b.Provision(ctx, "readahead", "g"))

	partitioner := keyPartitioner.ForTopic("readahead")
	partitionOf := func(key string) int { return partitioner.Partition(&kgo.Record{Key: []byte(key)}, 2) }
	publish := func(keys ...string) {
		var batch []adapters.Outgoing
		for _, k := range keys {
			msg := message.NewMessage(fmt.Sprintf("%s-%d", k, len(batch)), []byte(`{}`))
			msg.Metadata.Set(envelope.AggregateIDKey, k)
			batch = append(batch, adapters.Outgoing{Topic: "readahead", Msg: msg})
		}
		require.NoError(t, b.PublishBatch(ctx, batch))
	}
	var hot []string
	for range 21 {
		hot = append(hot, "hot")
	}
	var others []string
	for i := 0; len(others) < 3; i++ {
		if k := fmt.Sprintf("other-%d", i); partitionOf(k) != partitionOf("hot") {
			others = append(others, k)
		}
	}
	publish(hot...)

	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: "g", Ordered: true, InFlight: 4})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, "readahead")
	require.NoError(t, err)
	first := adaptertest.Next(t, msgs, 30*time.Second)
	require.Equal(t, "hot", first.Metadata.Get(envelope.AggregateIDKey))
	time.Sleep(300 * time.Millisecond) // the hot partition reads its backlog meanwhile

	publish(others...)
	got := map[string]bool{}
	for range others {
		m := adaptertest.Next(t, msgs, 30*time.Second)
		got[m.Metadata.Get(envelope.AggregateIDKey)] = true
		m.Ack()
	}
	for _, k := range others {
		require.True(t, got[k], "%s of the other partition was handed out while hot's message was in flight", k)
	}
	first.Ack()
	second := adaptertest.Next(t, msgs, 30*time.Second)
	require.Equal(t, "hot", second.Metadata.Get(envelope.AggregateIDKey), "hot's next message once the first is acked")
	second.Ack()
}
