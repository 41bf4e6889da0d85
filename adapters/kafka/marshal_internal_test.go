package kafka

import (
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
)

// TestKeyPartitionerMatchesJavaClient checks the partition of keyed records
// against murmur2 values from Kafka's own tests (UtilsTest.testMurmur2): the
// Java client's partition is (murmur2(key) & 0x7fffffff) % partitions.
func TestKeyPartitionerMatchesJavaClient(t *testing.T) {
	t.Parallel()
	p := keyPartitioner.ForTopic("orders")
	for _, c := range []struct {
		key     string
		murmur2 int32
	}{
		{"21", -973932308},
		{"foobar", -790332482},
		{"a-little-bit-long-string", -985981536},
		{"a-little-bit-longer-string", -1486304829},
		{"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971},
		{"abc", 479470107},
	} {
		for _, n := range []int{1, 3, 6, 7, 12, 100} {
			got := p.Partition(&kgo.Record{Key: []byte(c.key)}, n)
			want := int(uint32(c.murmur2)&0x7fffffff) % n
			assert.Equal(t, want, got, "key %q over %d partitions", c.key, n)
		}
	}
	assert.True(t, p.RequiresConsistency(&kgo.Record{Key: []byte("k")}), "a keyed record waits for its own partition")
	assert.False(t, p.RequiresConsistency(&kgo.Record{}), "a record without a key may go to any partition")
}

// TestRecordIsWatermillKafkasFormat: the records PublishBatch sends carry
// what Marshaler (and so watermill-kafka's subscriber) reads: the payload as
// value, the aggregate id as key, the UUID and every metadata entry as
// headers.
func TestRecordIsWatermillKafkasFormat(t *testing.T) {
	t.Parallel()
	b := &Broker{rules: rules{maxBytes: DefaultMaxMessageBytes}}
	msg := message.NewMessage("id-1", []byte(`{"n":1}`))
	msg.Metadata.Set(envelope.AggregateIDKey, "order-7")
	msg.Metadata.Set("x-unknown", "kept")
	r, err := b.record(adapters.Outgoing{Topic: "orders", Msg: msg})
	require.NoError(t, err)
	assert.Equal(t, "orders", r.Topic)
	assert.Equal(t, "order-7", string(r.Key))
	assert.Equal(t, `{"n":1}`, string(r.Value))

	cm := &sarama.ConsumerMessage{Key: r.Key, Value: r.Value}
	for _, h := range r.Headers {
		cm.Headers = append(cm.Headers, &sarama.RecordHeader{Key: []byte(h.Key), Value: h.Value})
	}
	back, err := Marshaler{}.Unmarshal(cm)
	require.NoError(t, err)
	assert.Equal(t, msg.UUID, back.UUID)
	assert.Equal(t, msg.Metadata, back.Metadata)

	noKey, err := b.record(adapters.Outgoing{Topic: "orders", Msg: message.NewMessage("id-2", nil)})
	require.NoError(t, err)
	assert.Nil(t, noKey.Key, "no aggregate id: no key, so the record may go to any partition")
}

// TestRecordSizeLimit: a message whose record batch would exceed
// max_message_bytes is refused before sending, naming the limit; one that
// fits is sized at least as kgo sizes it, so the producer never refuses it.
func TestRecordSizeLimit(t *testing.T) {
	t.Parallel()
	const limit = 4096
	b := &Broker{rules: rules{maxBytes: limit}}
	msg := message.NewMessage("id-1", make([]byte, limit))
	_, err := b.record(adapters.Outgoing{Topic: "orders", Msg: msg})
	require.ErrorIs(t, err, adapters.ErrMessageTooLarge)
	assert.True(t, adapters.IsPermanent(err))
	assert.Contains(t, err.Error(), "4096 bytes (broker.kafka.max_message_bytes)")

	small := message.NewMessage("id-2", make([]byte, limit-200))
	small.Metadata.Set(envelope.AggregateIDKey, "order-7")
	r, err := b.record(adapters.Outgoing{Topic: "orders", Msg: small})
	require.NoError(t, err)
	assert.LessOrEqual(t, batchBytes(r), limit)
	assert.Greater(t, batchBytes(r), len(r.Key)+len(r.Value)+61, "the count includes Kafka's 61-byte record batch header")
}

func TestMarshalerKeyAndHeaders(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("id-1", []byte(`{}`))
	msg.Metadata.Set(envelope.AggregateIDKey, "order-7")
	msg.Metadata.Set("x-unknown", "kept")
	pm, err := Marshaler{}.Marshal("orders", msg)
	require.NoError(t, err)
	key, err := pm.Key.Encode()
	require.NoError(t, err)
	assert.Equal(t, "order-7", string(key))

	headers := map[string]string{}
	for _, h := range pm.Headers {
		headers[string(h.Key)] = string(h.Value)
	}
	assert.Equal(t, "kept", headers["x-unknown"])

	back, err := Marshaler{}.Unmarshal(&sarama.ConsumerMessage{Key: key, Value: []byte(`{}`), Headers: recordHeaders(pm.Headers)})
	require.NoError(t, err)
	assert.Equal(t, "id-1", back.UUID)
	assert.Equal(t, "kept", back.Metadata.Get("x-unknown"))
	assert.Equal(t, "order-7", back.Metadata.Get(envelope.AggregateIDKey))

	noKey, err := Marshaler{}.Marshal("orders", message.NewMessage("id-2", nil))
	require.NoError(t, err)
	assert.Nil(t, noKey.Key, "no aggregate id: no key, so the record may go to any partition")
}

func recordHeaders(hs []sarama.RecordHeader) []*sarama.RecordHeader {
	out := make([]*sarama.RecordHeader, len(hs))
	for i := range hs {
		out[i] = &hs[i]
	}
	return out
}
