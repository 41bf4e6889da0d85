// Package brokertest points a test's millrace config at a real broker of
// each kind (the local servers `make up` provides, a real cluster named in
// the environment, or for Kafka an in-process kfake cluster) and removes the
// topology a test created on shared servers.
package brokertest

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
	"github.com/millrace-io/millrace/bus"
)

// Kinds are the broker kinds every end-to-end test runs on.
var Kinds = []string{bus.KindKafka, bus.KindNATS, bus.KindRabbitMQ}

// NATSURL is the local NATS server's URL, or NATS_URL. It is for a child
// process of a test, which has no testing.TB for Apply.
func NATSURL() string { return envOr("NATS_URL", "nats://127.0.0.1:4222") }

// amqpURL is the local RabbitMQ's URL, or AMQP_URL.
func amqpURL() string { return envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/") }

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

var (
	devOnce  sync.Once
	devAddrs []string
	devErr   error
)

// KafkaBrokers returns KAFKA_BROKERS or the addresses of a kfake cluster
// shared by the whole test process.
func KafkaBrokers(t testing.TB) []string {
	if v := os.Getenv("KAFKA_BROKERS"); v != "" {
		return strings.Split(v, ",")
	}
	devOnce.Do(func() {
		var dev *kafkadev.Cluster
		dev, devErr = kafkadev.Start(kafkadev.Options{})
		if devErr == nil {
			devAddrs = dev.Addrs()
		}
	})
	if devErr != nil {
		t.Fatalf("start the Kafka dev cluster: %v", devErr)
	}
	return devAddrs
}

// Apply sets cfg's broker section for kind.
func Apply(t testing.TB, kind string, cfg *bus.Config) {
	t.Helper()
	cfg.Broker.Kind = kind
	switch kind {
	case bus.KindKafka:
		cfg.Broker.Kafka.Brokers = KafkaBrokers(t)
		if os.Getenv("KAFKA_BROKERS") == "" {
			cfg.Broker.Kafka.ReplicationFactor = 3
		}
	case bus.KindNATS:
		cfg.Broker.NATS.URL = NATSURL()
	case bus.KindRabbitMQ:
		cfg.Broker.RabbitMQ.URL = amqpURL()
	default:
		t.Fatalf("unknown broker kind %q", kind)
	}
}

// Cleanup removes, when the test ends, what millrace created on a shared
// server for topic and its consumer groups: the NATS stream, or the RabbitMQ
// exchanges and queues. Kafka topics live in the per-process dev cluster.
func Cleanup(t testing.TB, kind, topic string, groups ...string) {
	t.Helper()
	if kind == bus.KindKafka {
		return
	}
	var cfg bus.Config
	Apply(t, kind, &cfg)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		b, err := bus.OpenBroker(ctx, cfg, nil)
		if err != nil {
			t.Logf("cleanup: %v", err)
			return
		}
		defer b.Close()
		if err := b.Deprovision(ctx, topic, groups...); err != nil {
			t.Logf("cleanup: %v", err)
		}
	})
}

// EachKind runs test on every broker kind of Kinds, each in a parallel
// subtest named after the kind.
func EachKind(t *testing.T, test func(t *testing.T, kind string)) {
	t.Helper()
	for _, kind := range Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			test(t, kind)
		})
	}
}
