package rabbit

import (
	"slices"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/confload"
)

// Kind returns Kind (adapters.Section).
func (c Config) Kind() string { return Kind }

// CloudEventsPrefix is "cloudEvents_", the header prefix of the
// CloudEvents AMQP protocol binding (adapters.Section).
func (c Config) CloudEventsPrefix() string { return "cloudEvents_" }

// ValidateConsumers refuses consumer.start: all, in the consumer section
// and in each handler override that sets it, sorted by path: a new group's
// queue cannot start at the topic's history (ErrNoHistory).
// adapters.Section.
func (c Config) ValidateConsumers(_ string, consumers []adapters.ConsumerSettings) []error {
	var paths []string
	for _, s := range consumers {
		if s.Start == adapters.StartAll {
			paths = append(paths, s.Path+".start")
		}
	}
	slices.Sort(paths)
	var chk confload.Checker
	for _, path := range paths {
		chk.Add(path, "must be new with broker.kind %s: %v; got all", Kind, ErrNoHistory)
	}
	return chk.Problems
}
