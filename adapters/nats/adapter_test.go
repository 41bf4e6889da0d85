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
	t.Run("Embedded", func(t *testing.T) {
		t.Parallel()
		srv := servers.StartEmbeddedNATS(t)
		const limit = 64 * 1024
		adaptertest.Run(t, adaptertest.Harness{
			NewBroker: func(t *testing.T) adapters.Broker {
				return openBroker(t, srv.URL, func(c *Config) {
					suiteConfig(c)
					c.Stream.MaxMsgSize = limit // the server-side limit of the stream
				})
			},
			RestartBroker:   func(t *testing.T) { srv.Restart() },
			MaxMessageBytes: limit,
		})
	})
	t.Run("Shared", func(t *testing.T) {
		t.Parallel()
		url := sharedURL()
		maxPayload := openBroker(t, url, nil).nc.MaxPayload()
		adaptertest.Run(t, adaptertest.Harness{
			NewBroker: func(t *testing.T) adapters.Broker {
				return openBroker(t, url, suiteConfig)
			},
			// The client-side limit: the server's max_payload.
			MaxMessageBytes: int(maxPayload),
		})
	})
	t.Run("ServerProcess", func(t *testing.T) {
		t.Parallel()
		proc := servers.StartNATS(t)
		const limit = 32 * 1024
		adaptertest.Run(t, adaptertest.Harness{
			NewBroker: func(t *testing.T) adapters.Broker {
				return openBroker(t, proc.URL, func(c *Config) {
					suiteConfig(c)
					c.Stream.MaxMsgSize = limit
				})
			},
			RestartBroker:   func(*testing.T) { proc.Kill(); proc.Start() },
			MaxMessageBytes: limit,
		})
	})
}
