package kafka

import (
	"github.com/IBM/sarama"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/internal/envelope"
)

// Marshaler turns Watermill messages into Kafka records and back: the payload
// is the record value, every metadata entry a header (the message UUID in
// watermill-kafka's "_watermill_message_uuid" header), and the record key the
// event's aggregate id (metadata "aggregate-id"), so all events of one
// aggregate land on one partition, in order.
//
// watermill-kafka's NewWithPartitioningMarshaler is not used: it always sets a
// key, and the empty key of a message without an aggregate id hashes every
// such message to one partition. Here those messages get no key and spread
// over the partitions.
type Marshaler struct {
	wkafka.DefaultMarshaler
}

var _ wkafka.MarshalerUnmarshaler = Marshaler{}

// Marshal returns the record for msg on topic.
func (m Marshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	pm, err := m.DefaultMarshaler.Marshal(topic, msg)
	if err != nil {
		return nil, err
	}
	if key := msg.Metadata.Get(envelope.AggregateIDKey); key != "" {
		pm.Key = sarama.StringEncoder(key)
	}
	return pm, nil
}

// keyPartitioner places a keyed record as Kafka's Java client does,
// murmur2(key) masked to 31 bits modulo the partition count, so other Kafka
// clients that hash the same aggregate id agree on its partition. Sarama's own
// hash partitioner uses FNV-1a, which no other ecosystem shares. Records
// without a key go to a random partition.
type keyPartitioner struct {
	keyed  kgo.TopicPartitioner
	random sarama.Partitioner
}

func newKeyPartitioner(topic string) sarama.Partitioner {
	return &keyPartitioner{
		keyed:  kgo.StickyKeyPartitioner(nil).ForTopic(topic),
		random: sarama.NewRandomPartitioner(topic),
	}
}

func (p *keyPartitioner) Partition(msg *sarama.ProducerMessage, n int32) (int32, error) {
	if msg.Key == nil {
		return p.random.Partition(msg, n)
	}
	key, err := msg.Key.Encode()
	if err != nil {
		return -1, err
	}
	return int32(p.keyed.Partition(&kgo.Record{Key: key}, int(n))), nil
}

// RequiresConsistency is true: a keyed record waits for its own partition
// rather than going to another one while that partition has no leader.
func (p *keyPartitioner) RequiresConsistency() bool { return true }

// MessageRequiresConsistency lets records without a key go to any partition
// that is available.
func (p *keyPartitioner) MessageRequiresConsistency(msg *sarama.ProducerMessage) bool {
	return msg.Key != nil
}
