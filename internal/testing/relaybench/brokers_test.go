package relaybench_test

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/adapters/rabbit"
)

func envOr(env map[string]string, key, def string) string {
	if v := env[key]; v != "" {
		return v
	}
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func init() {
	brokers["nats"] = brokerKit{
		open: func(ctx context.Context, env map[string]string) (adapters.Broker, error) {
			return nats.Open(ctx, nats.Config{URL: envOr(env, "NATS_URL", "nats://127.0.0.1:4222")}, adapters.Options{})
		},
	}
	brokers["rabbitmq"] = brokerKit{
		open: func(ctx context.Context, env map[string]string) (adapters.Broker, error) {
			// The bench's consumer takes 500 deliveries at a time, so that it
			// keeps up with a drain (with prefetch 1 it is the slowest part
			// of the run); relays only publish.
			return rabbit.Open(ctx, rabbit.Config{URL: envOr(env, "AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), Prefetch: 500}, adapters.Options{})
		},
	}
	brokers["kafka"] = brokerKit{
		// A real cluster when KAFKA_BROKERS is set, else an in-process dev
		// cluster (kfake) shared by the parent and the relay's process.
		start: func(b *testing.B) map[string]string {
			if os.Getenv("KAFKA_BROKERS") != "" {
				return nil
			}
			dev, err := kafkadev.Start(kafkadev.Options{})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(dev.Close)
			return map[string]string{"KAFKA_BROKERS": strings.Join(dev.Addrs(), ",")}
		},
		open: func(ctx context.Context, env map[string]string) (adapters.Broker, error) {
			return kafka.Open(ctx, kafka.Config{Brokers: strings.Split(envOr(env, "KAFKA_BROKERS", ""), ",")}, adapters.Options{})
		},
	}
}
