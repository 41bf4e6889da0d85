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

// section is the config section of the broker broker.kind selects and its
// YAML path: the one place a broker kind is mapped to its adapter. It is
// nil for an unknown kind.
func (c BrokerConfig) section() (path string, s adapters.Section) {
	switch c.Kind {
	case KindKafka:
		return "broker.kafka", c.Kafka
	case KindRabbitMQ:
		return "broker.rabbitmq", c.RabbitMQ
	case KindNATS:
		return "broker.nats", c.NATS
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
	for _, kind := range []string{KindKafka, KindRabbitMQ, KindNATS} {
		if err := (BrokerConfig{Kind: kind}).Rules().CheckTopic(topic); err != nil {
			errs = append(errs, fmt.Errorf("topic on broker.kind %s: %w", kind, err))
		}
	}
	return errors.Join(errs...)
}

// cloudEventsPrefix is the header prefix of the CloudEvents binding of
// broker.kind, "" when outbox.cloudevents is off.
func (c Config) cloudEventsPrefix() string {
	if !c.Outbox.CloudEvents.Enabled {
		return ""
	}
	switch c.Broker.Kind {
	case KindKafka:
		return "ce_" // Kafka protocol binding
	case KindRabbitMQ:
		return "cloudEvents_" // AMQP protocol binding
	default:
		return "ce-" // NATS protocol binding
	}
}
