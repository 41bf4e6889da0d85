package nats

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// broker.nats.embedded.enabled runs the server inside Open; Close stops it;
// the next Open on the same store directory finds the messages again.
func TestOpenWithEmbeddedServer(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cfg := Config{URL: "nats://127.0.0.1:0", Embedded: EmbeddedConfig{Enabled: true, StoreDir: dir}}
	b, err := Open(context.Background(), cfg, adapters.Options{})
	require.NoError(t, err)
	require.NotEqual(t, "nats://127.0.0.1:0", b.URL(), "the URL has the port picked")
	topic := adaptertest.Name("kept")
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("k1"), newMsg("k2"))))
	addr := strings.TrimPrefix(b.URL(), "nats://")
	require.NoError(t, b.Close())
	_, err = net.DialTimeout("tcp", addr, time.Second)
	require.Error(t, err, "Close stopped the embedded server")

	cfg.URL = "nats://" + addr // the same port, the same store
	b2 := openBroker(t, cfg.URL, func(c *Config) { c.Embedded = cfg.Embedded })
	require.EqualValues(t, 2, streamMsgs(t, b2, topic))
	require.Equal(t, []string{"k1", "k2"}, ids(adaptertest.Receive(t, adaptertest.Subscribe(t, b2, topic, "g"), 2, time.Minute)))
}

func ids(msgs []*message.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.UUID
	}
	return out
}

// A port already in use is a clear error, not a process exit.
func TestEmbeddedPortInUse(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	_, err = Open(context.Background(), Config{URL: "nats://" + l.Addr().String(), Embedded: EmbeddedConfig{Enabled: true, StoreDir: t.TempDir()}}, adapters.Options{})
	require.ErrorContains(t, err, fmt.Sprintf("embedded server cannot listen on %s", l.Addr()))
	require.ErrorContains(t, err, "address already in use")
}
