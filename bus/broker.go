package bus

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/adapters"
)

// OpenBroker connects to the broker cfg.Broker.Kind selects, with that
// adapter's reliable defaults, within broker.connect_timeout. It applies
// cfg's defaults and validates it first. It is what Run uses; the
// command-line tool and tests use it too.
func OpenBroker(ctx context.Context, cfg Config, logger watermill.LoggerAdapter) (adapters.Broker, error) {
	cfg, err := cfg.check()
	if err != nil {
		return nil, err
	}
	return connectBroker(ctx, cfg, logger)
}

// connectBroker connects with cfg, which has its defaults and is valid.
func connectBroker(ctx context.Context, cfg Config, logger watermill.LoggerAdapter) (adapters.Broker, error) {
	_, section := cfg.Broker.section()
	if section == nil {
		return nil, fmt.Errorf("millrace: broker.kind %q has no adapter", cfg.Broker.Kind) // unreachable after Validate
	}
	return section.Connect(ctx, adapters.Options{Logger: logger, ConnectTimeout: cfg.Broker.ConnectTimeout})
}

// sections are the broker sections of the config, each selected by its
// Kind.
func (c BrokerConfig) sections() []adapters.Section {
	return []adapters.Section{c.Kafka, c.RabbitMQ, c.NATS}
}

// kinds are the broker kinds the config has a section for.
func (c BrokerConfig) kinds() []string {
	var kinds []string
	for _, s := range c.sections() {
		kinds = append(kinds, s.Kind())
	}
	return kinds
}

// section is the config section of the broker broker.kind selects and its
// YAML path, broker.<kind>. It is nil for an unknown kind.
func (c BrokerConfig) section() (path string, s adapters.Section) {
	for _, s := range c.sections() {
		if s.Kind() == c.Kind {
			return "broker." + s.Kind(), s
		}
	}
	return "", nil
}

// Rules are what the selected broker carries unchanged, known from the
// config alone, so Publish and Handle check against them without a
// connection. An unknown kind (which Validate reports) has NATS's rules.
func (c BrokerConfig) Rules() adapters.Rules {
	if _, s := c.section(); s != nil {
		return s.Rules()
	}
	return c.NATS.Rules()
}

// checkTopicOnEveryBroker reports why topic cannot carry messages on each
// broker kind that refuses it, naming the kind and its rule: a Topic is
// declared once, in code that services on any broker share, so it must be
// valid on all of them.
func checkTopicOnEveryBroker(topic string) error {
	var errs []error
	for _, s := range (BrokerConfig{}).sections() {
		if err := s.Rules().CheckTopic(topic); err != nil {
			errs = append(errs, fmt.Errorf("topic on broker.kind %s: %w", s.Kind(), err))
		}
	}
	return errors.Join(errs...)
}

// cloudEventsPrefix is the header prefix of the CloudEvents binding of
// broker.kind, "" when outbox.cloudevents is off. An unknown kind (which
// Validate reports) has NATS's.
func (c Config) cloudEventsPrefix() string {
	if !c.Outbox.CloudEvents.Enabled {
		return ""
	}
	if _, s := c.Broker.section(); s != nil {
		return s.CloudEventsPrefix()
	}
	return c.Broker.NATS.CloudEventsPrefix()
}
