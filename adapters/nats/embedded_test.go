package nats

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/adaptertest"
)

// embedded.sync reaches the server: "always" fsyncs every write, a duration
// sets the background flush interval.
func TestEmbeddedSyncSetting(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		sync         string
		wantAlways   bool
		wantInterval time.Duration
	}{
		{"always", true, 0},
		{"", true, 0}, // the default
		{"2m", false, 2 * time.Minute},
		{"250ms", false, 250 * time.Millisecond},
	} {
		srv, err := StartEmbedded("nats://127.0.0.1:0", EmbeddedConfig{StoreDir: t.TempDir(), Sync: tc.sync}, nil)
		require.NoError(t, err, tc.sync)
		js := srv.srv.JetStreamConfig()
		srv.Shutdown()
		require.Equal(t, tc.wantAlways, js.SyncAlways, "sync %q", tc.sync)
		if !tc.wantAlways {
			require.Equal(t, tc.wantInterval, js.SyncInterval, "sync %q", tc.sync)
		}
	}
	_, err := StartEmbedded("nats://127.0.0.1:0", EmbeddedConfig{StoreDir: t.TempDir(), Sync: "sometimes"}, nil)
	require.ErrorContains(t, err, `must be "always" or a positive duration such as "2m"; got "sometimes"`)
}

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
	require.NoError(t, b.PublishBatch(context.Background(), batchOf(topic, newMsg("k1"), newMsg("k2"))))
	addr := b.embedded.srv.Addr().String()
	require.NoError(t, b.Close())
	_, err = net.DialTimeout("tcp", addr, time.Second)
	require.Error(t, err, "Close stopped the embedded server")

	cfg.URL = "nats://" + addr // the same port, the same store
	b2 := openBroker(t, cfg.URL, func(c *Config) { c.Embedded = cfg.Embedded })
	require.EqualValues(t, 2, streamMsgs(t, b2, topic))
	require.Equal(t, []string{"k1", "k2"}, ids(receiveN(t, subscribeGroup(t, b2, topic, "g"), 2)))
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
