package kafka

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/adapters"
)

const brokerKind = "kafka"

// Rules returns what Kafka carries unchanged with this configuration:
// headers are bytes, so only the header Watermill's marshaler keeps the
// message id in and the two a retry topic's records carry (RetryDeliveryKey,
// RetryDueKey) are reserved, and a record (value, key and headers) must fit
// max_message_bytes as a record batch of its own. Topic names are already
// valid Kafka names when names.Topic accepts them.
func (c Config) Rules() adapters.Rules { return rules{maxBytes: c.MaxMessageBytes} }

type rules struct{ maxBytes int }

func (rules) CheckTopic(string) error { return nil }

func (rules) CheckGroup(string, string) error { return nil }

func (r rules) CheckMessage(topic string, msg *message.Message) error {
	if err := adapters.CheckWatermillUUIDHeader(brokerKind, msg); err != nil {
		return err // before marshaling, which would overwrite it
	}
	for _, key := range []string{RetryDeliveryKey, RetryDueKey} {
		if _, ok := msg.Metadata[key]; ok {
			return adapters.Refused(brokerKind, adapters.PartHeaderName, key,
				"reserved: a retry topic's record carries its next delivery in it (broker.kafka.retry_topics)")
		}
	}
	rec, err := toRecord(topic, msg)
	if err != nil {
		return err
	}
	return r.checkRecord(msg, rec)
}

// checkRecord checks msg, marshaled as rec.
func (r rules) checkRecord(msg *message.Message, rec *kgo.Record) error {
	if err := adapters.CheckWatermillUUIDHeader(brokerKind, msg); err != nil {
		return err
	}
	if n := batchBytes(rec); n > r.maxBytes {
		return adapters.Refused(brokerKind, adapters.PartSize, "",
			"%d bytes as a record batch with key and headers, over the limit of %d bytes (broker.kafka.max_message_bytes)", n, r.maxBytes)
	}
	return nil
}

// Rules returns the rules of the Broker's configuration (Config.Rules).
func (b *Broker) Rules() adapters.Rules { return b.rules }

// Capabilities: see adapters.Capabilities.
func (b *Broker) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{
		KeyPartitioned: true, OrderedFlight: true, ConcurrentFlight: true,
		ScheduledRedelivery: b.cfg.RetryTopics, RedeliveryNeedsFlight: true,
		Backlog: true, Ping: true,
	}
}
