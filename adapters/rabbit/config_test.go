package rabbit

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c := Config{URL: defaultURL}.WithDefaults()
	require.Equal(t, Config{
		URL:                  defaultURL,
		Prefetch:             1,
		DeliveryLimit:        20,
		MaxMessageBytes:      128 << 20,
		Heartbeat:            10 * time.Second,
		ReconnectMaxInterval: 5 * time.Second,
		TLS:                  adapters.TLSConfig{MinVersion: adapters.TLS12},
	}, c)
	require.Empty(t, c.Validate("broker.rabbitmq"))
	set := Config{URL: defaultURL, Prefetch: 50, DeliveryLimit: 3, MaxMessageBytes: 1 << 20, Heartbeat: time.Minute, ReconnectMaxInterval: time.Second,
		TLS: adapters.TLSConfig{MinVersion: adapters.TLS13}}
	require.Equal(t, set, set.WithDefaults(), "set values are kept")
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	c := Config{
		URL:                  "http://user:hunter2@host/",
		Prefetch:             70000,
		DeliveryLimit:        -1,
		MaxMessageBytes:      1 << 30,
		Heartbeat:            500 * time.Millisecond,
		ReconnectMaxInterval: -time.Second,
	}
	errs := c.Validate("broker.rabbitmq")
	paths := map[string]string{}
	for _, err := range errs {
		var fe *confload.FieldError
		require.True(t, errors.As(err, &fe), "%T", err)
		paths[fe.Path] = fe.Problem
		require.NotContains(t, fe.Problem, "hunter2")
	}
	require.Len(t, errs, 6, "%v", errs)
	require.Contains(t, paths["broker.rabbitmq.url"], "scheme")
	require.Contains(t, paths["broker.rabbitmq.prefetch"], "65535")
	require.Contains(t, paths["broker.rabbitmq.delivery_limit"], "greater than 0")
	require.Contains(t, paths["broker.rabbitmq.max_message_bytes"], "536870912")
	require.Contains(t, paths["broker.rabbitmq.heartbeat"], "at least 1s")
	require.Contains(t, paths["broker.rabbitmq.reconnect_max_interval"], "positive")

	require.Empty(t, Config{}.WithDefaults().Validate("broker.rabbitmq"), "the defaults are valid: a local server")
	require.Equal(t, DefaultURL, Config{}.WithDefaults().URL)
}

// broker.rabbitmq.url takes a cluster's nodes as a list; each is checked,
// one scheme for all, and the broker's errors name them without passwords.
func TestConfigClusterList(t *testing.T) {
	t.Parallel()
	c := Config{URL: "amqp://u:hunter2@a:5672/, amqp://u:hunter2@b:5672/"}.WithDefaults()
	require.Empty(t, c.Validate("broker.rabbitmq"))
	require.Equal(t, []string{"amqp://u:hunter2@a:5672/", "amqp://u:hunter2@b:5672/"}, c.urls())
	require.True(t, c.urlCredentials())
	require.NotContains(t, redactList(c.urls()), "hunter2")

	for _, tc := range []struct{ url, want string }{
		{"amqp://a/,http://b/", "scheme"},
		{"amqp://a/,amqps://b/", "every node of the list uses one scheme; got amqp:// and amqps://"},
	} {
		errs := Config{URL: tc.url}.WithDefaults().Validate("broker.rabbitmq")
		require.Len(t, errs, 1, "%s: %v", tc.url, errs)
		var fe *confload.FieldError
		require.ErrorAs(t, errs[0], &fe)
		require.Equal(t, "broker.rabbitmq.url", fe.Path)
		require.Contains(t, fe.Problem, tc.want)
	}
}

// The shipped config.yaml states this section's defaults.
func TestShippedConfigStatesDefaults(t *testing.T) {
	t.Parallel()
	var shipped Config
	noEnv := func(string) (string, bool) { return "", false }
	require.Empty(t, confload.Decode(adaptertest.ShippedSection(t, "rabbitmq"), &shipped, noEnv))
	require.Equal(t, Config{URL: shipped.URL}.WithDefaults(), shipped)
}
