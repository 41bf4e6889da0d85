package kafka

import (
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
)

const brokerKind = "kafka"

// Upper bounds of what a record adds to its key, value and headers in a
// record batch of its own (format v2): the batch header, the record's
// varints, and each header's two length varints.
const (
	recordBatchOverhead = 61
	recordOverhead      = 36
	headerOverhead      = 10
)

// Rules returns what Kafka carries unchanged with this configuration:
// headers are bytes, so only the header Watermill's marshaler keeps the
// message id in is reserved, and a record (value, key and headers, with
// the framing recordSize counts) must fit max_message_bytes. Topic names
// are already valid Kafka names when names.Topic accepts them.
func (c Config) Rules() adapters.Rules { return rules{maxBytes: c.MaxMessageBytes} }

type rules struct{ maxBytes int }

func (rules) CheckTopic(string) error { return nil }

func (rules) CheckGroup(string, string) error { return nil }

func (r rules) CheckMessage(_ string, msg *message.Message) error {
	if err := adapters.CheckWatermillUUIDHeader(brokerKind, msg); err != nil {
		return err
	}
	if n := recordSize(msg); n > r.maxBytes {
		return adapters.Refused(brokerKind, adapters.PartSize, "",
			"a record of up to %d bytes (value, key, headers and framing), over broker.kafka.max_message_bytes (%d bytes)", n, r.maxBytes)
	}
	return nil
}

// recordSize bounds the size of msg as a record in a batch of its own.
func recordSize(msg *message.Message) int {
	n := recordBatchOverhead + recordOverhead + len(msg.Payload) + len(msg.Metadata.Get(envelope.AggregateIDKey))
	n += headerOverhead + len(adapters.WatermillUUIDHeader) + len(msg.UUID)
	for k, v := range msg.Metadata {
		n += headerOverhead + len(k) + len(v)
	}
	return n
}

// Rules returns the rules of the Broker's configuration (Config.Rules).
func (b *Broker) Rules() adapters.Rules { return b.cfg.Rules() }
