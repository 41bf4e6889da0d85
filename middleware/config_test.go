package middleware

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/confload"
)

func TestDefaults(t *testing.T) {
	t.Parallel()
	c := Config{}.WithDefaults()
	require.Equal(t, 8, c.Workers)
	require.Equal(t, 16, c.EffectivePrefetch())
	require.False(t, *c.Ordered)
	require.False(t, *c.OrderingGuard)
	require.True(t, *c.Inbox.Enabled)
	require.True(t, *c.Breaker.Enabled)
	require.True(t, *c.Retry.Jitter)
	require.Equal(t, PoisonToTable, c.Poison.Destination)
	require.Equal(t, 5, c.Retry.MaxAttempts)
	require.Equal(t, 30*24*time.Hour, c.Inbox.Retention)
	require.Empty(t, c.Validate("consumer"))
}

func TestOverrideReplacesOnlyTheFieldsItSets(t *testing.T) {
	t.Parallel()
	c := Config{
		Workers: 4,
		Retry:   RetryConfig{MaxAttempts: 3, InitialInterval: time.Second, MaxInterval: 20 * time.Second},
		Handlers: map[string]Config{
			"billing": {
				Ordered: new(true),
				Retry:   RetryConfig{MaxAttempts: 10, Jitter: new(false)},
				Inbox:   InboxConfig{Enabled: new(false)},
			},
		},
	}.WithDefaults()

	billing := c.For("billing")
	require.Equal(t, 4, billing.Workers, "inherited from the section")
	require.True(t, *billing.Ordered)
	require.Equal(t, 10, billing.Retry.MaxAttempts, "overridden")
	require.Equal(t, time.Second, billing.Retry.InitialInterval, "a sibling field is inherited")
	require.Equal(t, 20*time.Second, billing.Retry.MaxInterval)
	require.False(t, *billing.Retry.Jitter, "a boolean can be overridden to false")
	require.False(t, *billing.Inbox.Enabled)
	require.Equal(t, DefaultInboxRetention, billing.Inbox.Retention)
	require.Nil(t, billing.Handlers)

	other := c.For("shipping")
	require.Equal(t, 3, other.Retry.MaxAttempts, "a handler without an override gets the section")
	require.True(t, *other.Inbox.Enabled)
	require.True(t, *other.Retry.Jitter)
	require.False(t, *c.Ordered, "For does not change the defaults")
}

func TestOverrideFromYAML(t *testing.T) {
	t.Parallel()
	var c Config
	errs := confload.Decode([]byte(`
workers: 4
breaker: {open_timeout: 30s}
handlers:
  billing:
    workers: 1
    breaker: {enabled: false}
`), &c, nil)
	require.Empty(t, errs)
	billing := c.WithDefaults().For("billing")
	require.Equal(t, 1, billing.Workers)
	require.False(t, *billing.Breaker.Enabled)
	require.Equal(t, 30*time.Second, billing.Breaker.OpenTimeout)
}

func TestValidateNamesYAMLPaths(t *testing.T) {
	t.Parallel()
	paths := func(errs []error) []string {
		var out []string
		for _, err := range errs {
			var fe *confload.FieldError
			require.True(t, errors.As(err, &fe), "%v", err)
			out = append(out, fe.Path)
		}
		return out
	}

	bad := Config{
		Workers:  -1,
		Prefetch: -3,
		Retry:    RetryConfig{MaxAttempts: -1, Multiplier: 0.5, InitialInterval: time.Second, MaxInterval: time.Millisecond, Mode: "broker"},
		Breaker:  BreakerConfig{ConsecutiveFailures: -2, OpenTimeout: -time.Second},
		Poison:   PoisonConfig{Destination: "dlq"},
		Inbox:    InboxConfig{CleanupBatch: -1},
	}.WithDefaults()
	require.ElementsMatch(t, []string{
		"consumer.workers", "consumer.prefetch", "consumer.retry.max_attempts", "consumer.retry.multiplier",
		"consumer.retry.max_interval", "consumer.retry.mode", "consumer.breaker.consecutive_failures", "consumer.breaker.open_timeout",
		"consumer.poison.destination", "consumer.inbox.cleanup_batch",
	}, paths(bad.Validate("consumer")))

	overrides := Config{Handlers: map[string]Config{
		"billing": {
			Prefetch: 2,
			Poison:   PoisonConfig{Destination: PoisonToTopic},
			Inbox:    InboxConfig{Retention: time.Hour},
			Handlers: map[string]Config{"nested": {}},
		},
		"shipping": {Poison: PoisonConfig{Destination: PoisonToTopic, Topic: "billing.poison"}},
	}}.WithDefaults()
	errs := overrides.Validate("consumer")
	require.ElementsMatch(t, []string{
		"consumer.handlers.billing.prefetch", "consumer.handlers.billing.poison.topic",
		"consumer.handlers.billing.inbox.retention", "consumer.handlers.billing.handlers",
	}, paths(errs))
	require.Contains(t, errors.Join(errs...).Error(), "consumer.handlers.billing.prefetch: must be at least workers (8); got 2")
}

func TestBatchConfig(t *testing.T) {
	t.Parallel()
	c := Config{}.WithDefaults()
	require.Equal(t, DefaultBatchMaxMessages, c.Batch.MaxMessages)
	require.Equal(t, DefaultBatchMaxWait, c.Batch.MaxWait)

	var fromYAML Config
	require.Empty(t, confload.Decode([]byte(`
batch: {max_messages: -2, max_wait: -1ms}
handlers:
  billing:
    handler_timeout: 1s
    batch: {max_wait: 1s}
  shipping:
    batch: {max_messages: 1}
  audit:
    batch: {max_messages: 65}
`), &fromYAML, nil))
	errs := fromYAML.WithDefaults().Validate("consumer")
	msg := errors.Join(errs...).Error()
	require.Contains(t, msg, "consumer.batch.max_messages: must be greater than 0; got -2")
	require.Contains(t, msg, "consumer.batch.max_wait")

	fromYAML.Batch = BatchConfig{}
	errs = fromYAML.WithDefaults().Validate("consumer")
	msg = errors.Join(errs...).Error()
	require.Len(t, errs, 2, msg)
	require.Contains(t, msg, "consumer.handlers.audit.batch.max_messages: must be at most 64; got 65")
	require.Contains(t, msg, "consumer.handlers.billing.batch.max_wait: must be less than handler_timeout (1s); got 1s")
	require.Equal(t, 1, fromYAML.WithDefaults().For("shipping").Batch.MaxMessages, "batch size 1 per handler")
}
