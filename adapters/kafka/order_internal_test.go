package kafka

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// When the producer gives up on a record batch (its producer_retries spent
// while the partition's leader keeps refusing it: a broker outage longer
// than the retry budget), PublishBatch must not confirm a later message of
// the same key in the same call, and the partition log must not hold one.
// The relay acks the longest confirmed prefix and sends the rest again; a
// later message stored now would be in the log before the earlier one the
// relay sends again, and the key's order (adapters.Broker.PublishBatch,
// README "Ordering and concurrency") would be lost. Sarama's producer gave
// up on the failed record batch, bumped its idempotent epoch and went on
// with the record batches queued behind it; kgo fails them with it.
//
// Found by internal/testing/faults' broker-restart scenario (a kfake restart of 2s
// against a 10 x 250ms retry budget); reproduced here with the broker
// refusing the first produce requests.
func TestPublishBatchConfirmsNothingOfAKeyAfterAFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(3)) // kfake itself: the test drives its control hooks
	require.NoError(t, err)
	defer cluster.Close()
	const retries = 2
	b, err := Open(ctx, Config{Brokers: cluster.ListenAddrs(), ProducerRetries: retries, ProducerRetryBackoff: 500 * time.Millisecond},
		adapters.Options{ConnectTimeout: 10 * time.Second})
	require.NoError(t, err)
	defer b.Close()
	topic := fmt.Sprintf("order-after-failure-%d", time.Now().UnixNano())
	require.NoError(t, b.Provision(ctx, topic))

	// The leader refuses the first record batch and each of its retries,
	// then accepts everything.
	refuseFirstProduces(cluster, retries+1)

	const n = 50
	batch := make([]adapters.Outgoing, n)
	for i := range batch {
		msg := message.NewMessage(fmt.Sprintf("v%02d", i), []byte(`{}`))
		msg.Metadata.Set(envelope.AggregateIDKey, "order-1") // one key: one partition
		batch[i] = adapters.Outgoing{Topic: topic, Msg: msg}
	}
	err = b.PublishBatch(ctx, batch)
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be, "the refused record batch fails")
	first := -1
	for i, e := range be.Errs {
		if e != nil && first < 0 {
			first = i
		}
		if first >= 0 && e == nil {
			require.Failf(t, "order of a key broken", "message %d of key order-1 was confirmed after message %d of the same key failed "+
				"(%v): re-sending from message %d stores it after messages %d..%d", i, first, be.Errs[first], first, first+1, i)
		}
	}

	// As the relay does: send again from the first failed message. The log
	// then holds every message, each first copy in order.
	require.NoError(t, b.PublishBatch(ctx, batch[first:]))
	order := firstCopies(t, cluster.ListenAddrs(), topic, n)
	for i, id := range order {
		require.Equal(t, fmt.Sprintf("v%02d", i), id, "first copies in the log: %v", order)
	}
}

// refuseFirstProduces makes the leader refuse the first times produce
// requests (NOT_LEADER_FOR_PARTITION), then accept everything.
func refuseFirstProduces(cluster *kfake.Cluster, times int) {
	var refused atomic.Int32
	cluster.ControlKey(kmsg.Produce.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		if refused.Load() >= int32(times) {
			cluster.DropControl()
			return nil, nil, false
		}
		refused.Add(1)
		pr := req.(*kmsg.ProduceRequest)
		resp := pr.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range pr.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID // produce v13 names topics by id
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.NotLeaderForPartition.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
}

// firstCopies reads topic from the start until it has seen n messages and
// returns their UUIDs in the order of their first copies in the log.
func firstCopies(t *testing.T, brokers []string, topic string, n int) []string {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	require.NoError(t, err)
	defer cl.Close()
	readCtx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var order []string
	seen := map[string]bool{}
	for len(seen) < n {
		fetches := cl.PollFetches(readCtx)
		require.NoError(t, readCtx.Err(), "the log holds %d of %d messages", len(seen), n)
		fetches.EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == wkafka.UUIDHeaderKey && !seen[string(h.Value)] {
					seen[string(h.Value)] = true
					order = append(order, string(h.Value))
				}
			}
		})
	}
	return order
}

// A record that fails while a call is still handing its records to the
// client (here one with no topic, which fails at once) must keep the rest
// of the call from being sent: the later records of its partition would go
// into a fresh buffer and could be written before it. send finds such a
// failure with its fence and sends nothing.
func TestSendSendsNothingAfterAnEarlyFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dev, err := kafkadev.Start(kafkadev.Options{})
	require.NoError(t, err)
	defer dev.Close()
	b, err := Open(ctx, Config{Brokers: dev.Addrs()}, adapters.Options{ConnectTimeout: 10 * time.Second})
	require.NoError(t, err)
	defer b.Close()
	topic := fmt.Sprintf("early-failure-%d", time.Now().UnixNano())
	require.NoError(t, b.Provision(ctx, topic))

	var records []*kgo.Record
	for i := range 20 {
		msg := message.NewMessage(fmt.Sprintf("v%02d", i), []byte(`{}`))
		msg.Metadata.Set(envelope.AggregateIDKey, "order-1")
		r, err := b.record(adapters.Outgoing{Topic: topic, Msg: msg})
		require.NoError(t, err)
		records = append(records, r)
	}
	records[5].Topic = "" // fails before it is buffered
	errs := make([]error, len(records))
	b.send(ctx, records, errs)
	for i, err := range errs {
		require.Error(t, err, "record %d", i)
		assert.False(t, adapters.IsPermanent(classify(topic, err)), "record %d: %v", i, err)
		if i != 5 {
			assert.ErrorContains(t, err, "not sent: another message of the batch failed before it was sent", "record %d", i)
		}
	}

	ends, err := b.admin.ListEndOffsets(ctx, topic)
	require.NoError(t, err)
	ends.Each(func(o kadm.ListedOffset) {
		require.NoError(t, o.Err)
		assert.Zero(t, o.Offset, "partition %d holds records of the failed call", o.Partition)
	})

	// The client is usable again: the next call goes through.
	records[5].Topic = topic
	for i := range records {
		records[i] = &kgo.Record{Topic: topic, Key: records[i].Key, Value: records[i].Value, Headers: records[i].Headers}
	}
	errs = make([]error, len(records))
	b.send(ctx, records, errs)
	for i, err := range errs {
		require.NoError(t, err, "record %d", i)
	}
}

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
