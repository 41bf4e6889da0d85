package bus

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/adapters/rabbit"
)

// OpenBroker connects to the broker cfg.Broker.Kind selects, with that
// adapter's reliable defaults, within broker.connect_timeout. It is what
// Run uses; the command-line tool and tests use it too.
func OpenBroker(ctx context.Context, cfg Config, logger watermill.LoggerAdapter) (adapters.Broker, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	opts := adapters.Options{Logger: logger, ConnectTimeout: cfg.Broker.ConnectTimeout}
	switch cfg.Broker.Kind {
	case KindKafka:
		return kafka.Open(ctx, cfg.Broker.Kafka, opts)
	case KindRabbitMQ:
		return rabbit.Open(ctx, cfg.Broker.RabbitMQ, opts)
	case KindNATS:
		return nats.Open(ctx, cfg.Broker.NATS, opts)
	}
	return nil, fmt.Errorf("millrace: broker.kind %q has no adapter", cfg.Broker.Kind) // unreachable after Validate
}

// Rules are what the selected broker carries unchanged, known from the
// config alone, so Publish and Handle check against them without a connection.
func (c BrokerConfig) Rules() adapters.Rules {
	switch c.Kind {
	case KindKafka:
		return c.Kafka.Rules()
	case KindRabbitMQ:
		return c.RabbitMQ.Rules()
	default:
		return c.NATS.Rules()
	}
}
