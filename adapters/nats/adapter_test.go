package nats

import (
	"testing"
	"time"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
)

// suiteConfig is what the contract suites change from the defaults: a short
// nak delay, so the redelivery tests do not wait 5s per nack.
func suiteConfig(c *Config) {
	c.Consumer.NakDelay = 100 * time.Millisecond
	// What a killed server had delivered and not seen acked comes back after
	// ack_wait: well inside the contract's 60s wait for messages, not at its
	// edge as with the 60s default.
	c.Consumer.AckWait = 10 * time.Second
}

// TestContract runs millrace's adapter contract against (a) an in-process
// embedded server (restarted in place for the restart test), (b) the shared
// server at NATS_URL (never restarted) and (c) a private nats-server process
// that the restart test kills with SIGKILL and starts again.
func TestContract(t *testing.T) {
	t.Parallel()
	for _, server := range []struct {
		name string
		// limit is the stream's max_msg_size, the server-side limit; 0 leaves
		// the client-side one, the server's max_payload.
		limit int32
		// start returns the server's URL and, unless it is never restarted,
		// how to restart it.
		start func(t *testing.T) (url string, restart func())
	}{
		{"Embedded", 64 * 1024, func(t *testing.T) (string, func()) {
			srv := servers.StartEmbeddedNATS(t)
			return srv.URL, func() { srv.Restart() }
		}},
		{"Shared", 0, func(*testing.T) (string, func()) { return sharedURL(), nil }},
		{"ServerProcess", 32 * 1024, func(t *testing.T) (string, func()) {
			proc := servers.StartNATS(t)
			return proc.URL, func() { proc.Kill(); proc.Start() }
		}},
	} {
		t.Run(server.name, func(t *testing.T) {
			t.Parallel()
			url, restart := server.start(t)
			h := adaptertest.Harness{
				NewBroker: func(t *testing.T) adapters.Broker {
					return openBroker(t, url, func(c *Config) {
						suiteConfig(c)
						c.Stream.MaxMsgSize = server.limit
					})
				},
				MaxMessageBytes: int(server.limit),
			}
			if server.limit == 0 {
				h.MaxMessageBytes = int(openBroker(t, url, nil).nc.MaxPayload())
			}
			if restart != nil {
				h.RestartBroker = func(*testing.T) { restart() }
			}
			adaptertest.Run(t, h)
		})
	}
}
