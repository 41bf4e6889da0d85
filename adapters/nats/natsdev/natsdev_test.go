package natsdev

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Options.Sync (broker.nats.embedded.sync) reaches the server: "always" fsyncs every write, a duration
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
		srv, err := Start("nats://127.0.0.1:0", Options{StoreDir: t.TempDir(), Sync: tc.sync})
		require.NoError(t, err, tc.sync)
		js := srv.srv.JetStreamConfig()
		srv.Shutdown()
		require.Equal(t, tc.wantAlways, js.SyncAlways, "sync %q", tc.sync)
		if !tc.wantAlways {
			require.Equal(t, tc.wantInterval, js.SyncInterval, "sync %q", tc.sync)
		}
	}
	_, err := Start("nats://127.0.0.1:0", Options{StoreDir: t.TempDir(), Sync: "sometimes"})
	require.ErrorContains(t, err, `must be "always" or a positive duration such as "2m"; got "sometimes"`)
}
