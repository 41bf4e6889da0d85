package adapters

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Rules says what one broker carries unchanged: which topics and consumer
// groups it accepts beyond the names every broker shares (names.Topic), and
// which message ids, header names, header values and sizes it would refuse,
// drop or alter. bus.Publish and bus.Handle ask the configured broker's
// Rules before anything is written, so such input is refused at the call;
// each adapter asks them again before it publishes, so a row written by
// another writer (plain Watermill, an older version) fails permanently and
// the relay quarantines it instead of the broker mangling it.
type Rules interface {
	// CheckTopic reports why topic cannot carry messages on this broker.
	CheckTopic(topic string) error
	// CheckGroup reports why consumerGroup cannot consume topic on this
	// broker (for example a derived queue name over the broker's limit).
	CheckGroup(topic, consumerGroup string) error
	// CheckMessage reports, as a permanent *RefusedError, the first part of
	// msg that this broker would refuse or not carry unchanged on topic.
	CheckMessage(topic string, msg *message.Message) error
}

// Part names the part of a message a *RefusedError is about.
type Part string

// The parts of a message a broker may refuse.
const (
	PartTopic       Part = "topic"        // the destination topic
	PartID          Part = "id"           // the message id (the event id)
	PartHeaderName  Part = "header name"  // a metadata key
	PartHeaderValue Part = "header value" // a metadata value
	PartSize        Part = "size"         // payload and headers together
)

// WatermillUUIDHeader is the header in which the Watermill marshalers of
// every broker (watermill-kafka, watermill-amqp, watermill-nats) carry the
// message UUID. Metadata must not use it: the marshaler would overwrite it.
const WatermillUUIDHeader = "_watermill_message_uuid"

// RefusedError says which part of a message a broker refuses, or would
// drop or alter, and why. It is permanent: the same message is refused
// again however often it is sent.
type RefusedError struct {
	// Broker is the broker kind: "kafka", "rabbitmq" or "nats".
	Broker string
	// Part is what is at fault.
	Part Part
	// Key is the metadata key at fault, for PartHeaderName and PartHeaderValue.
	Key string
	// Problem says what is wrong and what the broker allows.
	Problem string
}

// Unwrap returns ErrMessageTooLarge for PartSize, so every size refusal
// matches it.
func (e *RefusedError) Unwrap() error {
	if e.Part == PartSize {
		return ErrMessageTooLarge
	}
	return nil
}

func (e *RefusedError) Error() string {
	if e.Key != "" {
		return fmt.Sprintf("%s: %s %q: %s", e.Broker, e.Part, e.Key, e.Problem)
	}
	return fmt.Sprintf("%s: %s: %s", e.Broker, e.Part, e.Problem)
}

// Permanent is true: a broker refuses the same message again.
func (e *RefusedError) Permanent() bool { return true }

// Refused returns a *RefusedError.
func Refused(broker string, part Part, key, format string, args ...any) error {
	return &RefusedError{Broker: broker, Part: part, Key: key, Problem: fmt.Sprintf(format, args...)}
}

// CheckWatermillUUIDHeader refuses metadata that uses WatermillUUIDHeader,
// for every broker's CheckMessage.
func CheckWatermillUUIDHeader(broker string, msg *message.Message) error {
	if _, ok := msg.Metadata[WatermillUUIDHeader]; ok {
		return Refused(broker, PartHeaderName, WatermillUUIDHeader,
			"reserved: the Watermill marshaler carries the message id in it")
	}
	return nil
}
