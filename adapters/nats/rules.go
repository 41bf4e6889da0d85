package nats

import (
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/millrace-io/millrace/adapters"
)

// maxHeaderBytes is JetStream's limit on a stored message's headers.
const maxHeaderBytes = 64 * 1024

// Rules returns what NATS JetStream carries unchanged with this
// configuration: topics that are valid subjects (no empty token), header
// names NATS accepts and does not act on, headers within JetStream's 64 KiB
// and, when stream.max_msg_size is set, messages within it. Header values
// and message ids need no rule: the marshaler encodes what NATS would alter.
func (c Config) Rules() adapters.Rules { return rules{maxMsgSize: int(c.Stream.MaxMsgSize)} }

type rules struct{ maxMsgSize int }

const brokerKind = "nats"

func (rules) CheckTopic(topic string) error {
	if err := checkTopic(topic); err != nil {
		return adapters.Refused(brokerKind, adapters.PartTopic, "", "%v", err)
	}
	return nil
}

func (rules) CheckGroup(_, group string) error {
	if err := checkGroup(group); err != nil {
		return adapters.Permanent(err)
	}
	return nil
}

func (r rules) CheckMessage(topic string, msg *message.Message) error {
	if err := r.CheckTopic(topic); err != nil {
		return err
	}
	for k := range msg.Metadata {
		if err := checkHeaderKey(k); err != nil {
			return adapters.Refused(brokerKind, adapters.PartHeaderName, k, "%v", err)
		}
	}
	headers := headerSize(msg)
	if headers > maxHeaderBytes {
		return adapters.Refused(brokerKind, adapters.PartSize, "",
			"%d bytes of headers (encoded), over JetStream's limit of %d bytes", headers, maxHeaderBytes)
	}
	if r.maxMsgSize > 0 && len(msg.Payload)+headers > r.maxMsgSize {
		return adapters.Refused(brokerKind, adapters.PartSize, "",
			"%d bytes with headers, over the stream's max_msg_size limit of %d bytes (broker.nats.stream.max_msg_size)", len(msg.Payload)+headers, r.maxMsgSize)
	}
	return nil
}

// headerSize is the size of msg's headers as PublishBatch sends them: the
// marshaler's headers plus Nats-Msg-Id, counted the way nats.Msg sizes
// them, without marshaling (the rules run on every Publish).
func headerSize(msg *message.Message) int {
	const line = len(": \r\n")
	size := len("NATS/1.0\r\n") + len("\r\n") +
		len(wmnats.WatermillUUIDHdr) + encodedLen(msg.UUID) + line +
		len(nats.MsgIdHdr) + encodedLen(msg.UUID) + line // msgID is encodeValue
	for k, v := range msg.Metadata {
		size += len(k) + encodedLen(v) + line
	}
	return size
}

// Rules returns the rules of the Broker's configuration (Config.Rules).
func (b *Broker) Rules() adapters.Rules { return b.rules }

// Capabilities: see adapters.Capabilities.
func (b *Broker) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{
		DeduplicatesByID: true, OrderedFlight: true, ConcurrentFlight: true,
		ScheduledRedelivery: true, OrderedGroups: true, Backlog: true, Ping: true,
	}
}
