package kafka

import (
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/envelope"
)

// TestKeyPartitionerMatchesJavaClient checks the partition of keyed records
// against murmur2 values from Kafka's own tests (UtilsTest.testMurmur2): the
// Java client's partition is (murmur2(key) & 0x7fffffff) % partitions.
func TestKeyPartitionerMatchesJavaClient(t *testing.T) {
	t.Parallel()
	p := newKeyPartitioner("orders")
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
		for _, n := range []int32{1, 3, 6, 7, 12, 100} {
			got, err := p.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(c.key)}, n)
			require.NoError(t, err)
			want := int32(uint32(c.murmur2)&0x7fffffff) % n
			assert.Equal(t, want, got, "key %q over %d partitions", c.key, n)
		}
	}
	assert.True(t, p.(sarama.DynamicConsistencyPartitioner).MessageRequiresConsistency(
		&sarama.ProducerMessage{Key: sarama.StringEncoder("k")}))
	assert.False(t, p.(sarama.DynamicConsistencyPartitioner).MessageRequiresConsistency(&sarama.ProducerMessage{}))
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
