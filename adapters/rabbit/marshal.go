package rabbit

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/millrace-io/millrace/adapters"
)

// Headers RabbitMQ itself sets on a delivery. They reach the handler as
// metadata (converted to strings) but are never published: they describe one
// delivery, not the event.
const (
	// DeliveryCountKey is the metadata key of the quorum queue's redelivery
	// count ("x-delivery-count"), absent on a first delivery. A handler may
	// read it as the attempt number; at Config.DeliveryLimit the message is
	// dead-lettered.
	DeliveryCountKey = "x-delivery-count"
	// DeathKey is the metadata key of RabbitMQ's dead-lettering history
	// ("x-death"), as JSON: an array of {queue, reason, count, exchange,
	// routing-keys, time}. Messages read from a dead-letter queue carry it.
	DeathKey = "x-death"
)

// brokerHeader reports whether key is a header RabbitMQ owns. Publishing one
// again would be wrong (the new message has not died nor been redelivered)
// and, for x-death as a string, would trip RabbitMQ's own dead-lettering,
// which expects an array there.
func brokerHeader(key string) bool {
	return key == DeliveryCountKey || key == DeathKey || key == receivedFromKey || key == DeliveryNumberKey ||
		strings.HasPrefix(key, "x-first-death-") || strings.HasPrefix(key, "x-last-death-")
}

// receivedFromKey is set by the shovel and federation plugins on what they move.
const receivedFromKey = "x-received-from"

// maxHeaderNameBytes is AMQP's limit on a header (field table) name: a short string.
const maxHeaderNameBytes = 255

// Marshaler maps Watermill messages to AMQP publishings and back; this
// adapter uses it, and it plugs into watermill-amqp's own publisher and
// subscriber (Config.Marshaler) as well. It replaces watermill-amqp's
// DefaultMarshaler, whose Unmarshal fails on any header that
// is not a string: quorum queues add x-delivery-count (a long) to every
// redelivery and x-death (an array) when dead-lettering, so with the stock
// marshaler a redelivered message never reaches the handler (the failed
// unmarshal nacks it, which redelivers it, until the delivery limit).
//
// Unmarshal never fails: every header becomes metadata as a string.
type Marshaler struct{}

var _ wamqp.Marshaler = Marshaler{}

// uuidHeader carries msg.UUID, under the name watermill-amqp uses, so
// Watermill's own AMQP subscribers read the same id.
const uuidHeader = wamqp.DefaultMessageUUIDHeaderKey

// Marshal returns msg as a persistent publishing: metadata as string headers,
// the event id in the uuid header and in the message-id property. A metadata
// key longer than AMQP allows is a permanent error.
func (Marshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	headers := make(amqp.Table, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		if brokerHeader(k) {
			continue
		}
		if len(k) > maxHeaderNameBytes {
			return amqp.Publishing{}, adapters.Permanent(fmt.Errorf(
				"rabbitmq: metadata key %.40q... is %d bytes; AMQP header names are at most %d bytes",
				k, len(k), maxHeaderNameBytes))
		}
		headers[k] = v
	}
	headers[uuidHeader] = msg.UUID
	return amqp.Publishing{
		Headers:      headers,
		Body:         msg.Payload,
		DeliveryMode: amqp.Persistent,
		MessageId:    msg.UUID,
	}, nil
}

// Unmarshal returns the delivery as a Watermill message. The id is the uuid
// header, else the message-id property (a message published by another
// client). Header values that are not strings are converted by headerString.
func (Marshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	id := d.MessageId
	if v, ok := d.Headers[uuidHeader].(string); ok {
		id = v
	}
	msg := message.NewMessage(id, d.Body)
	for k, v := range d.Headers {
		if k == uuidHeader {
			continue
		}
		msg.Metadata[k] = headerString(v)
	}
	return msg, nil
}

// headerString renders an AMQP field value as metadata: strings as they are,
// numbers in decimal, times in RFC 3339, tables and arrays (x-death) as JSON.
func headerString(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case []byte:
		return string(v)
	case bool:
		return strconv.FormatBool(v)
	case int, int8, int16, int32, int64, uint8, uint16, uint32, uint64:
		return fmt.Sprint(v) // decimal
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32)
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64)
	case time.Time:
		return v.UTC().Format(time.RFC3339)
	case amqp.Decimal:
		return decimalString(v)
	default:
		if b, err := json.Marshal(jsonValue(v)); err == nil {
			return string(b)
		}
		return fmt.Sprint(v)
	}
}

// jsonValue prepares a table or array for JSON: byte slices as text and
// decimals and times as headerString renders them, instead of JSON's defaults
// (base64 and Go struct shapes).
func jsonValue(v any) any {
	switch v := v.(type) {
	case amqp.Table:
		out := make(map[string]any, len(v))
		for k, x := range v {
			out[k] = jsonValue(x)
		}
		return out
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = jsonValue(x)
		}
		return out
	case []byte, time.Time, amqp.Decimal:
		return headerString(v)
	default:
		return v
	}
}

// decimalString renders an AMQP decimal (Value * 10^-Scale) exactly.
func decimalString(d amqp.Decimal) string {
	s := strconv.FormatInt(int64(d.Value), 10)
	if d.Scale == 0 {
		return s
	}
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	scale := int(d.Scale)
	if len(s) <= scale {
		s = strings.Repeat("0", scale-len(s)+1) + s
	}
	s = s[:len(s)-scale] + "." + s[len(s)-scale:]
	if neg {
		s = "-" + s
	}
	return s
}
