package rabbit

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

func TestMarshalRoundTrip(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("ev-1", []byte(`{"a":1}`))
	msg.Metadata.Set(envelope.AggregateIDKey, "ord-1")
	msg.Metadata.Set("unknown-to-millrace", "ünïcode ✓")
	msg.Metadata.Set("empty", "")
	msg.Metadata.Set(DeliveryCountKey, "3")              // broker-owned: not published
	msg.Metadata.Set(DeathKey, `[{"reason":"expired"}]`) // broker-owned: not published
	msg.Metadata.Set("x-first-death-reason", "rejected")

	p, err := Marshaler{}.Marshal(msg)
	require.NoError(t, err)
	require.Equal(t, amqp.Persistent, p.DeliveryMode)
	require.Equal(t, "ev-1", p.MessageId)
	for _, k := range []string{DeliveryCountKey, DeathKey, "x-first-death-reason"} {
		require.NotContains(t, p.Headers, k)
	}
	require.NoError(t, p.Headers.Validate())

	got, err := Marshaler{}.Unmarshal(amqp.Delivery{Headers: p.Headers, Body: p.Body, MessageId: p.MessageId})
	require.NoError(t, err)
	require.Equal(t, "ev-1", got.UUID)
	require.Equal(t, msg.Payload, got.Payload)
	require.Equal(t, message.Metadata{
		envelope.AggregateIDKey: "ord-1",
		"unknown-to-millrace":   "ünïcode ✓",
		"empty":                 "",
	}, got.Metadata)
}

func TestMarshalRefusesLongHeaderName(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("ev-1", nil)
	msg.Metadata.Set(strings.Repeat("k", 256), "v")
	_, err := Marshaler{}.Marshal(msg)
	require.Error(t, err)
	require.True(t, adapters.IsPermanent(err))
	require.Contains(t, err.Error(), "255")
}

// Headers of other types (what RabbitMQ and other clients put there) become
// strings; Unmarshal never fails.
func TestUnmarshalNonStringHeaders(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	d := amqp.Delivery{
		MessageId: "from-property",
		Body:      []byte("x"),
		Headers: amqp.Table{
			DeliveryCountKey: int64(2),
			"i8":             int8(-8),
			"u8":             uint8(8),
			"i16":            int16(-16),
			"u16":            uint16(16),
			"i32":            int32(-32),
			"u32":            uint32(32),
			"f32":            float32(1.5),
			"f64":            2.25,
			"bool":           true,
			"bytes":          []byte("raw"),
			"void":           nil,
			"time":           at,
			"decimal":        amqp.Decimal{Scale: 2, Value: -1234},
			"decimal-small":  amqp.Decimal{Scale: 3, Value: 5},
			DeathKey: []any{amqp.Table{
				"count":        int64(1),
				"reason":       "delivery_limit",
				"queue":        "orders:billing",
				"time":         at,
				"routing-keys": []any{""},
			}},
			"table": amqp.Table{"nested": amqp.Table{"b": []byte("y")}},
		},
	}
	msg, err := Marshaler{}.Unmarshal(d)
	require.NoError(t, err)
	require.Equal(t, "from-property", msg.UUID, "no uuid header: the message-id property")
	want := map[string]string{
		DeliveryCountKey: "2",
		"i8":             "-8",
		"u8":             "8",
		"i16":            "-16",
		"u16":            "16",
		"i32":            "-32",
		"u32":            "32",
		"f32":            "1.5",
		"f64":            "2.25",
		"bool":           "true",
		"bytes":          "raw",
		"void":           "",
		"time":           "2026-03-01T12:00:00Z",
		"decimal":        "-12.34",
		"decimal-small":  "0.005",
		DeathKey:         `[{"count":1,"queue":"orders:billing","reason":"delivery_limit","routing-keys":[""],"time":"2026-03-01T12:00:00Z"}]`,
		"table":          `{"nested":{"b":"y"}}`,
	}
	for k, v := range want {
		require.Equal(t, v, msg.Metadata.Get(k), k)
	}
	require.Len(t, msg.Metadata, len(want))
}

// watermillSubscriber consumes queue (declared by the adapter) through
// watermill-amqp's own subscriber with marshaler.
func watermillSubscriber(t *testing.T, url, topic, group string, marshaler wamqp.Marshaler) <-chan *message.Message {
	t.Helper()
	cfg := wamqp.NewDurablePubSubConfig(url, func(topic string) string { return QueueName(topic, group) })
	cfg.Marshaler = marshaler
	cfg.TopologyBuilder = noTopology{} // the adapter declared it
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = sub.Close() })
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	return ch
}

type noTopology struct{}

func (noTopology) BuildTopology(*amqp.Channel, string, string, wamqp.Config, watermill.LoggerAdapter) error {
	return nil
}
func (noTopology) ExchangeDeclare(*amqp.Channel, string, wamqp.Config) error { return nil }

// The trap this package's Marshaler exists for: with watermill-amqp's
// DefaultMarshaler a quorum queue's redelivery (x-delivery-count is a long)
// never reaches the handler; it fails to unmarshal, is nacked, comes back,
// until the delivery limit dead-letters it. With Marshaler, the same
// subscriber gets the redelivery.
func TestStockMarshalerLosesRedeliveries(t *testing.T) {
	t.Parallel()
	cfg := testConfig(serverURL())
	cfg.DeliveryLimit = 3
	b := openBroker(t, cfg)
	for _, c := range []struct {
		name        string
		marshaler   wamqp.Marshaler
		redelivered bool
	}{
		{"DefaultMarshaler", wamqp.DefaultMarshaler{}, false},
		{"Marshaler", Marshaler{}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			topic, group := provisioned(t, b, "stock")
			ch := watermillSubscriber(t, cfg.URL, topic, group, c.marshaler)
			m := newMsg(`"x"`)
			require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, m)))
			first := <-ch
			require.Equal(t, m.UUID, first.UUID)
			first.Nack()
			select {
			case again := <-ch:
				require.True(t, c.redelivered, "unexpected redelivery")
				require.Equal(t, m.UUID, again.UUID)
				require.Equal(t, "1", again.Metadata.Get(DeliveryCountKey))
				again.Ack()
			case <-time.After(3 * time.Second):
				require.False(t, c.redelivered, "the redelivery never reached the handler")
				d := getOne(t, rawChannel(t, cfg.URL), DeadLetterQueueName(topic, group), 30*time.Second)
				require.Equal(t, m.UUID, d.MessageId, "dead-lettered without ever being handled again")
			}
		})
	}
}
