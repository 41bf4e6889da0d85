package nats

import (
	"encoding/base64"
	"fmt"
	"net/textproto"
	"strings"

	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/millrace-io/millrace/adapters"
)

// marshaler is watermill-nats's NATSMarshaler (payload as the body, msg.UUID
// in the _watermill_message_uuid header, each metadata entry as a header, so
// plain watermill-nats consumers read millrace's messages) with three
// guards it lacks, because NATS headers cannot carry every string:
//
//   - a value NATS would change (nats.go trims leading and trailing
//     whitespace and turns CR and LF into spaces) travels base64-encoded as
//     "=?utf-8?b?<base64>?=" and is decoded on receipt, so it arrives as sent;
//     a value that already starts with "=?utf-8?b?" is encoded the same way.
//     The message UUID in the _watermill_message_uuid header, and the
//     Nats-Msg-Id PublishBatch derives from it (msgID), are encoded alike,
//     so ids that differ only in white space stay apart;
//   - a key that is not a valid header name, or one the server acts on
//     ("Nats-..." such as Nats-Rollup, which would purge the stream), is a
//     permanent error naming the key instead of a message that is refused or
//     misread later;
//   - a header with several values (only another publisher can send one) is
//     read as its values joined by ", ", instead of failing to unmarshal, which
//     would leave the message unacked and redelivered forever.
type marshaler struct{}

const encodedPrefix, encodedSuffix = "=?utf-8?b?", "?="

var (
	_ wmnats.Marshaler   = marshaler{}
	_ wmnats.Unmarshaler = marshaler{}
)

func (marshaler) Marshal(topic string, msg *message.Message) (*nats.Msg, error) {
	md := make(message.Metadata, len(msg.Metadata))
	for k, v := range msg.Metadata {
		if err := checkHeaderKey(k); err != nil {
			return nil, adapters.Permanent(fmt.Errorf("nats: message %s: %w", msg.UUID, err))
		}
		md[k] = encodeValue(v)
	}
	wire := message.NewMessage(encodeValue(msg.UUID), msg.Payload)
	wire.Metadata = md
	return (&wmnats.NATSMarshaler{}).Marshal(topic, wire)
}

func (marshaler) Unmarshal(nm *nats.Msg) (*message.Message, error) {
	msg := message.NewMessage(decodeValue(nm.Header.Get(wmnats.WatermillUUIDHdr)), nm.Data)
	for k, vs := range nm.Header {
		switch k {
		case wmnats.WatermillUUIDHdr, nats.MsgIdHdr, nats.ExpectedLastMsgIdHdr, nats.ExpectedStreamHdr,
			nats.ExpectedLastSubjSeqHdr, nats.ExpectedLastSeqHdr:
			continue
		}
		msg.Metadata.Set(k, decodeValue(strings.Join(vs, ", ")))
	}
	return msg, nil
}

// msgID is the Nats-Msg-Id of a message with id: the id itself, or its
// encoded form when NATS would alter it, so that JetStream's duplicate window
// never takes two different ids for one.
func msgID(id string) string { return encodeValue(id) }

// encodeValue returns v as NATS carries it unchanged.
func encodeValue(v string) string {
	if !needsEncoding(v) {
		return v
	}
	return encodedPrefix + base64.StdEncoding.EncodeToString([]byte(v)) + encodedSuffix
}

// encodedLen is len(encodeValue(v)) without building the encoded string:
// the rules size every message at Publish and must not marshal it to do so.
func encodedLen(v string) int {
	if !needsEncoding(v) {
		return len(v)
	}
	return len(encodedPrefix) + base64.StdEncoding.EncodedLen(len(v)) + len(encodedSuffix)
}

// decodeValue reverses encodeValue.
func decodeValue(v string) string {
	if s, ok := strings.CutPrefix(v, encodedPrefix); ok {
		if s, ok := strings.CutSuffix(s, encodedSuffix); ok {
			if raw, err := base64.StdEncoding.DecodeString(s); err == nil {
				return string(raw)
			}
		}
	}
	return v
}

// needsEncoding reports whether NATS headers would not carry v unchanged.
func needsEncoding(v string) bool {
	return strings.ContainsAny(v, "\r\n") || textproto.TrimString(v) != v || strings.HasPrefix(v, encodedPrefix)
}

// checkHeaderKey reports a metadata key that cannot be a NATS header of a
// millrace message.
func checkHeaderKey(k string) error {
	if k == "" {
		return fmt.Errorf("metadata key is empty; NATS headers need a name")
	}
	for i := 0; i < len(k); i++ {
		if c := k[i]; c < 33 || c > 126 || strings.IndexByte(`"()/,:;<=>?@[\]{}`, c) >= 0 {
			return fmt.Errorf("metadata key %q is not a valid NATS header name (printable ASCII without spaces or %s)", k, `"()/,:;<=>?@[\]{}`)
		}
	}
	if strings.HasPrefix(strings.ToLower(k), "nats-") || k == wmnats.WatermillUUIDHdr {
		return fmt.Errorf("metadata key %q is reserved: the NATS server or watermill-nats acts on it", k)
	}
	return nil
}
