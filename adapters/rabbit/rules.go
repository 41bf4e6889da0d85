package rabbit

import (
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
)

const brokerKind = "rabbitmq"

// reservedHeader reports a header name RabbitMQ or a common plugin acts on,
// drops or overwrites: the delivery headers (brokerHeader), CC and BCC
// (sender-selected distribution routes by them and removes BCC), x-delay
// (the delayed-message exchange) and x-opt-* (AMQP 1.0 annotations). Names
// are compared without case, so no spelling of them slips through.
func reservedHeader(key string) bool {
	k := strings.ToLower(key)
	return brokerHeader(k) || k == "cc" || k == "bcc" || k == "x-delay" || strings.HasPrefix(k, "x-opt-")
}

// defaultFrameMax is the AMQP frame size RabbitMQ negotiates by default
// (frame_max 131072); a message's headers must fit one frame.
const defaultFrameMax = 131072

// frameOverhead is what an AMQP frame adds to its payload: frame type,
// channel, size and end octet.
const frameOverhead = 8

// Rules returns what RabbitMQ carries unchanged with this configuration:
// topics and consumer groups whose derived exchange and queue names fit
// AMQP's 255 bytes, message ids of at most 255 bytes (the message-id
// property), header names of at most 255 bytes that RabbitMQ does not act
// on (reservedHeader), headers that fit one frame, and bodies within
// max_message_bytes.
func (c Config) Rules() adapters.Rules { return rules{maxBody: c.MaxMessageBytes} }

type rules struct{ maxBody int }

func (rules) CheckTopic(topic string) error { return checkNames(topic) }

func (rules) CheckGroup(topic, group string) error { return checkNames(topic, group) }

func (r rules) CheckMessage(topic string, msg *message.Message) error {
	if err := checkNames(topic); err != nil {
		return err
	}
	if len(msg.UUID) > maxNameBytes {
		return adapters.Refused(brokerKind, adapters.PartID, "",
			"%d bytes; the AMQP message-id property holds at most %d", len(msg.UUID), maxNameBytes)
	}
	if err := adapters.CheckWatermillUUIDHeader(brokerKind, msg); err != nil {
		return err
	}
	for k := range msg.Metadata {
		switch {
		case reservedHeader(k):
			return adapters.Refused(brokerKind, adapters.PartHeaderName, k,
				"reserved: RabbitMQ (or a common plugin) sets, routes by or removes this header")
		case len(k) > maxHeaderNameBytes:
			return adapters.Refused(brokerKind, adapters.PartHeaderName, k,
				"%d bytes; AMQP header names are at most %d bytes", len(k), maxHeaderNameBytes)
		}
	}
	if n := len(msg.Payload); n > r.maxBody {
		return adapters.Refused(brokerKind, adapters.PartSize, "",
			"a %d-byte body, over broker.rabbitmq.max_message_bytes (%d bytes)", n, r.maxBody)
	}
	p, err := Marshaler{}.Marshal(msg)
	if err != nil {
		return err
	}
	if n := headerFrameBytes(p); n > defaultFrameMax-frameOverhead {
		return adapters.Refused(brokerKind, adapters.PartSize, "",
			"%d bytes of headers; they must fit one AMQP frame (%d bytes with RabbitMQ's default frame_max)", n, defaultFrameMax-frameOverhead)
	}
	return nil
}

// Rules returns the rules of the Broker's configuration (Config.Rules).
func (b *Broker) Rules() adapters.Rules { return b.rules }

// Capabilities: see adapters.Capabilities.
func (b *Broker) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{OrderedFlight: true, ConcurrentFlight: true, ScheduledRedelivery: true, Backlog: true, Ping: true}
}
