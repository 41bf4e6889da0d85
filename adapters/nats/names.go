package nats

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/millrace-io/millrace/internal/names"
)

// Each topic is the NATS subject its messages are published on, captured by a
// stream of its own; each consumer group of the topic is a durable consumer of
// that stream. JetStream forbids '.' in stream and consumer names, while
// topics such as "orders.events" are normal, so names are derived from
// topics and groups by an escaping that is deterministic and one to one:
//
//	'.' -> '_'    '-' -> "--"    '_' -> "-_"    letters and digits unchanged
//
// so "orders.events" is stream "orders_events", "order-created" is
// "order--created" and "billing_v2" is "billing-_v2". No two topics share a
// stream name: in the escaped text '-' always starts a two-character code, so
// it reads back one way only. A name whose escaped form is longer than
// maxNameLen characters (only possible for topics or groups of more than 100
// characters) is cut and ends in "-h" and 16 hex digits of the SHA-256 of the
// original, which keeps it under JetStream's 255-character limit and apart
// from every shorter name.

// maxNameLen is the longest escaped name used as is.
const maxNameLen = 200

// StreamName is the JetStream stream that holds topic's messages.
func StreamName(topic string) string { return escapeName(topic) }

// ConsumerName is the durable consumer (and its deliver group) of
// consumerGroup on a topic's stream. Consumers live inside their topic's
// stream, so the same group on two topics is two separate consumers, each
// with its own position.
func ConsumerName(consumerGroup string) string { return escapeName(consumerGroup) }

// deliverSubject is where the server pushes a consumer's messages.
// Topics start with a letter or digit, so no topic's subject starts with '_'
// and no stream can capture these.
func deliverSubject(stream, consumer string) string {
	return "_millrace.deliver." + stream + "." + consumer
}

func escapeName(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 8)
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '.':
			b.WriteByte('_')
		case '-':
			b.WriteString("--")
		case '_':
			b.WriteString("-_")
		default:
			b.WriteByte(c)
		}
	}
	out := b.String()
	if len(out) <= maxNameLen {
		return out
	}
	sum := sha256.Sum256([]byte(s))
	return out[:maxNameLen-17] + "-h" + hex.EncodeToString(sum[:8])
}

// checkTopic reports why topic cannot be a millrace topic on NATS: it must
// be a valid millrace topic name and a valid NATS subject (no empty token, so
// no leading, trailing or doubled '.').
func checkTopic(topic string) error {
	if err := names.Topic(topic); err != nil {
		return fmt.Errorf("topic %q: %w", topic, err)
	}
	if strings.HasSuffix(topic, ".") || strings.Contains(topic, "..") {
		return fmt.Errorf("topic %q: not a valid NATS subject: empty token between dots", topic)
	}
	return nil
}

// checkGroup reports why group cannot be a consumer group name.
func checkGroup(group string) error {
	if err := names.Topic(group); err != nil {
		return fmt.Errorf("consumer group %q: %w", group, err)
	}
	return nil
}
