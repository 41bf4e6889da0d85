package nats

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c := Config{URL: "nats://127.0.0.1:4222"}.WithDefaults()
	require.Equal(t, Config{
		URL: "nats://127.0.0.1:4222", PingInterval: 5 * time.Second,
		Stream: StreamConfig{
			Replicas: 1, MaxAge: 168 * time.Hour, DuplicateWindow: 2 * time.Minute,
		},
		Consumer: ConsumerConfig{
			AckWait: 60 * time.Second, MaxDeliver: -1, MaxAckPending: 32, NakDelay: 5 * time.Second, Subscribers: 1,
			LeaseTTL: 5 * time.Second,
		},
		Publish:  PublishConfig{Timeout: 30 * time.Second, MaxPending: 1024},
		Embedded: EmbeddedConfig{StoreDir: DefaultStoreDir(), Sync: SyncAlways},
		TLS:      adapters.TLSConfig{MinVersion: adapters.TLS12},
	}, c)
	require.Equal(t, c, c.WithDefaults(), "idempotent")
	require.Empty(t, c.Validate("broker.nats"))
}

// The shipped config.yaml states the defaults of broker.nats.
func TestConfigYAMLStatesDefaults(t *testing.T) {
	t.Parallel()
	section := adaptertest.ShippedSection(t, "nats")
	var c Config
	noEnv := func(string) (string, bool) { return "", false }
	require.Empty(t, confload.Decode(section, &c, noEnv))
	require.Equal(t, "", c.Embedded.StoreDir, "the file leaves store_dir to its default")
	require.Equal(t, Config{URL: "nats://127.0.0.1:4222"}.WithDefaults(), c.WithDefaults())

	// NATS_EMBEDDED=true turns the embedded server on.
	var on Config
	require.Empty(t, confload.Decode(section, &on, func(k string) (string, bool) {
		if k == "NATS_EMBEDDED" {
			return "true", true
		}
		return "", false
	}))
	require.True(t, on.Embedded.Enabled)
}

func TestConfigTakesAClusterSeedList(t *testing.T) {
	t.Parallel()
	c := Config{URL: "nats://a.example:4222, tls://user:secret@b.example:4222"}.WithDefaults()
	require.Empty(t, c.Validate("broker.nats"))
	require.True(t, c.tlsOn(), "a tls:// server in the list turns TLS on")
	require.Equal(t, []string{"url"}, c.authMethods())
	require.Equal(t, "nats://a.example:4222,tls://user:xxxxx@b.example:4222", redact(c.URL))
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{"no url", func(c *Config) { c.URL = "" }, "broker.nats.url: required"},
		{"ping_interval", func(c *Config) { c.PingInterval = -time.Second }, "broker.nats.ping_interval: must be a positive duration"},
		{"replicas", func(c *Config) { c.Stream.Replicas = 7 }, "broker.nats.stream.replicas: must be between 1 and 5; got 7"},
		{"max_age", func(c *Config) { c.Stream.MaxAge = -time.Second }, "broker.nats.stream.max_age: must be a positive duration"},
		{"max_bytes", func(c *Config) { c.Stream.MaxBytes = -2 }, "broker.nats.stream.max_bytes: must not be negative"},
		{"window over age", func(c *Config) { c.Stream.MaxAge = time.Minute; c.Stream.DuplicateWindow = time.Hour },
			"broker.nats.stream.duplicate_window: must not exceed stream.max_age (1m0s); got 1h0m0s"},
		{"max_msg_size", func(c *Config) { c.Stream.MaxMsgSize = -1 }, "broker.nats.stream.max_msg_size: must not be negative"},
		{"ack_wait", func(c *Config) { c.Consumer.AckWait = -1 }, "broker.nats.consumer.ack_wait: must be a positive duration"},
		{"max_deliver", func(c *Config) { c.Consumer.MaxDeliver = -5 }, "broker.nats.consumer.max_deliver: must be -1 (no limit) or at least 1; got -5"},
		{"max_ack_pending", func(c *Config) { c.Consumer.MaxAckPending = -1 }, "broker.nats.consumer.max_ack_pending: must be greater than 0"},
		{"nak_delay", func(c *Config) { c.Consumer.NakDelay = -time.Second }, "broker.nats.consumer.nak_delay: must be a positive duration"},
		{"subscribers", func(c *Config) { c.Consumer.Subscribers = -1 }, "broker.nats.consumer.subscribers: must be greater than 0"},
		{"lease_ttl", func(c *Config) { c.Consumer.LeaseTTL = -time.Second }, "broker.nats.consumer.lease_ttl: must be a positive duration"},
		{"publish timeout", func(c *Config) { c.Publish.Timeout = -1 }, "broker.nats.publish.timeout: must be a positive duration"},
		{"max_pending", func(c *Config) { c.Publish.MaxPending = -1 }, "broker.nats.publish.max_pending: must be greater than 0"},
		{"sync", func(c *Config) { c.Embedded.Sync = "never" }, `broker.nats.embedded.sync: must be "always" or a positive duration such as "2m"; got "never"`},
		{"cluster list with a bad server", func(c *Config) { c.URL = "nats://127.0.0.1:4222, http://127.0.0.1:4223" },
			`broker.nats.url: `},
		{"embedded on a list", func(c *Config) { c.Embedded.Enabled = true; c.URL = "nats://127.0.0.1:4222,nats://127.0.0.1:4223" },
			`broker.nats.url: the embedded server listens on one URL, not a list`},
		{"embedded port", func(c *Config) { c.Embedded.Enabled = true; c.URL = "nats://127.0.0.1:99999" },
			`broker.nats.url: the embedded server listens on this URL: invalid port "99999"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Config{URL: "nats://127.0.0.1:4222"}.WithDefaults()
			tc.mutate(&c)
			problems := c.Validate("broker.nats")
			require.Len(t, problems, 1, "%v", problems)
			var fe *confload.FieldError
			require.ErrorAs(t, problems[0], &fe)
			require.Contains(t, problems[0].Error(), tc.want)
		})
	}
}
