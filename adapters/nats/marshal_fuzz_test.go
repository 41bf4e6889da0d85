package nats

import (
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// FuzzHeadersRoundTrip sends arbitrary message ids, header names and values
// through a real NATS server as PublishBatch marshals them: what the Rules
// accept arrives byte for byte, and distinct ids never share a Nats-Msg-Id
// (JetStream would drop the second as a duplicate).
func FuzzHeadersRoundTrip(f *testing.F) {
	for _, s := range []struct{ id, key, value string }{
		{"id A", "note", " lead"}, {"id\rA", "note", "a\r\nb"}, {" id", "k", "=?utf-8?b?Zm9v?="},
		{"=?utf-8?b?aWQ=?=", "event-id", ""}, {"id", "my key", "v"}, {"id\t", "Nats-Rollup", "all"},
		{"ид", "ключ", "значение"}, {"\x00", "k", "\x00\x01"},
	} {
		f.Add(s.id, s.key, s.value, []byte(`{}`))
	}
	nc, err := nats.Connect(sharedURL())
	require.NoError(f, err)
	f.Cleanup(nc.Close)
	subject := "fuzz." + testdb.UniqueName("headers")
	sub, err := nc.SubscribeSync(subject)
	require.NoError(f, err)
	require.NoError(f, nc.Flush())
	r := Config{}.WithDefaults().Rules()
	ids := map[string]string{} // Nats-Msg-Id -> message id

	f.Fuzz(func(t *testing.T, id, key, value string, payload []byte) {
		if !utf8.ValidString(id) || !utf8.ValidString(key) || !utf8.ValidString(value) {
			return // outbox rows are JSON: their strings are valid UTF-8
		}
		msg := message.NewMessage(id, payload)
		if key != "" {
			msg.Metadata.Set(key, value)
		}
		if err := r.CheckMessage(subject, msg); err != nil {
			require.True(t, adapters.IsPermanent(err), "a refusal is permanent: %v", err)
			return
		}
		mid := msgID(id)
		if other, seen := ids[mid]; seen && other != id {
			t.Fatalf("ids %q and %q share Nats-Msg-Id %q", other, id, mid)
		}
		ids[mid] = id
		nm, err := marshaler{}.Marshal(subject, msg)
		require.NoError(t, err, "what the Rules accept marshals")
		nm.Header.Set(nats.MsgIdHdr, mid)
		require.Equal(t, nm.Size()-len(nm.Subject)-len(nm.Data), headerSize(msg), "the rules size the headers as NATS does")
		require.NoError(t, nc.PublishMsg(nm))
		got, err := sub.NextMsg(10 * time.Second)
		require.NoError(t, err)
		back, err := marshaler{}.Unmarshal(got)
		require.NoError(t, err)
		require.Equal(t, id, back.UUID)
		require.Equal(t, []byte(payload), []byte(back.Payload))
		require.Equal(t, id, decodeValue(got.Header.Get(nats.MsgIdHdr)), "the Nats-Msg-Id decodes to the id")
		for k, v := range msg.Metadata {
			require.Equal(t, v, back.Metadata.Get(k), "header %q", k)
		}
	})
}
