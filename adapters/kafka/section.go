package kafka

import "github.com/millrace-io/millrace/adapters"

// Kind returns Kind (adapters.Section).
func (c Config) Kind() string { return Kind }

// CloudEventsPrefix is "ce_", the header prefix of the CloudEvents Kafka
// protocol binding (adapters.Section).
func (c Config) CloudEventsPrefix() string { return "ce_" }

// ValidateConsumers finds no problem: every consumer setting is one a
// Kafka consumer group can have (adapters.Section).
func (c Config) ValidateConsumers(string, []adapters.ConsumerSettings) []error { return nil }
