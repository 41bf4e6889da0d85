package nats

import (
	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/confload"
)

// Kind returns Kind (adapters.Section).
func (c Config) Kind() string { return Kind }

// CloudEventsPrefix is "ce-", the header prefix of the CloudEvents NATS
// protocol binding (adapters.Section).
func (c Config) CloudEventsPrefix() string { return "ce-" }

// ValidateConsumers refuses a consumer.max_deliver below the
// retry.max_attempts of an unordered handler: its attempts are deliveries
// (the broker waits between them), and the server would stop delivering a
// failing message before the chain poisons it, leaving it in the stream
// unhandled, with only an advisory to tell. adapters.Section.
func (c Config) ValidateConsumers(path string, consumers []adapters.ConsumerSettings) []error {
	limit := c.Consumer.MaxDeliver
	if limit < 1 {
		return nil // -1: no limit
	}
	var chk confload.Checker
	for _, s := range consumers {
		if s.ScheduledRetries && s.MaxAttempts > limit {
			chk.Add(confload.Join(path, "consumer.max_deliver"), "must be -1 (no limit) or at least %s.retry.max_attempts (%d): "+
				"an unordered handler's attempts are JetStream deliveries, and the server would drop a failing message "+
				"for the group before it is poisoned; got %d", s.Path, s.MaxAttempts, limit)
		}
	}
	return chk.Problems
}
