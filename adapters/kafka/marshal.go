package kafka

import (
	"github.com/IBM/sarama"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

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
