package bus_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
)

// A config with several type errors reports them all at once, each at its
// YAML path; booleans are YAML 1.2's (true and false), and no message
// names a Go type.
func TestConfigTypeErrorsAllAtOnce(t *testing.T) {
	t.Parallel()
	_, err := bus.ParseConfig([]byte(`
broker:
  kind: nats
  nats: {url: "nats://127.0.0.1:4222"}
  kafka: {brokers: [a:9092, {host: b}]}
relay:
  batch_size: lots
consumer:
  ordered: "true"
  workers: many
  retry: {jitter: yes}
  handlers:
    billing: {ordered: on, breaker: {enabled: "false"}, inbox: {enabled: 1}}
`))
	var ce *bus.ConfigError
	require.True(t, errors.As(err, &ce), "%v", err)
	var got []string
	for _, p := range ce.Problems {
		got = append(got, p.Error())
		require.NotContains(t, p.Error(), "*bool")
		require.NotContains(t, p.Error(), "[]string")
	}
	require.Equal(t, []string{
		`broker.kafka.brokers[1]: expected a string, got a mapping`,
		`relay.batch_size: expected an integer, got "lots"`,
		`consumer.ordered: expected true or false, got the quoted string "true" (remove the quotes)`,
		`consumer.workers: expected an integer, got "many"`,
		`consumer.retry.jitter: expected true or false, got "yes" (YAML 1.2 booleans are true and false only)`,
		`consumer.handlers.billing.ordered: expected true or false, got "on" (YAML 1.2 booleans are true and false only)`,
		`consumer.handlers.billing.breaker.enabled: expected true or false, got the quoted string "false" (remove the quotes)`,
		`consumer.handlers.billing.inbox.enabled: expected true or false, got "1"`,
	}, got)

	cfg, err := bus.ParseConfig([]byte(`
broker: {nats: {url: "nats://127.0.0.1:4222"}}
consumer:
  ordered: true
  retry: {jitter: false}
  handlers:
    billing: {ordered: false, breaker: {enabled: FALSE}}
`))
	require.NoError(t, err)
	require.True(t, *cfg.Consumer.Ordered)
	require.False(t, *cfg.Consumer.Retry.Jitter)
	require.False(t, *cfg.Consumer.For("billing").Ordered, "an override sets false")
	require.False(t, *cfg.Consumer.For("billing").Breaker.Enabled)
}
