package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters/rabbit"
	"github.com/millrace-io/millrace/examples/billing"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnvKey) != "" { // relay #1, re-executed from this test binary
		os.Exit(runCrashingRelay())
	}
	os.Exit(m.Run())
}

// The seed scenario on every broker prints counts that add up.
func TestDemoScenarioOnEveryBroker(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, func(t *testing.T, kind string) {
		db := testdb.Open(t)
		schema := testdb.SchemaName(t, db, "demo_"+kind)
		config := "database:\n  url: " + testdb.URL() + "\nbroker:\n  kind: " + kind +
			"\n  rabbitmq:\n    url: amqp://guest:guest@127.0.0.1:5672/\n  nats:\n    url: nats://127.0.0.1:4222\n  kafka:\n    brokers: [127.0.0.1:9092]\n"
		path := filepath.Join(t.TempDir(), "config.yaml")
		require.NoError(t, os.WriteFile(path, []byte(config), 0o600))

		var out bytes.Buffer
		c, err := run(context.Background(), path, schema, 100, &out)
		require.NoError(t, err, out.String())
		require.Equal(t, 100, c.Orders)
		require.Zero(t, c.OutboxPending)
		// How many rows relay #1 read depends on the other sessions of
		// the shared server (a transaction still open holds back what the
		// relay may read), so its batch is 1 to firstBatch events.
		require.Positive(t, c.SentTwice, "relay #1 had a batch confirmed before it was killed")
		require.LessOrEqual(t, c.SentTwice, firstBatch)
		require.Equal(t, 100, c.InboxRows)
		require.Equal(t, 100, c.BillingRows)
		require.Equal(t, c.DeliveredBilling-100, c.DuplicatesSkipped, "every delivery beyond one per order was skipped by the inbox")
		if kind == bus.KindNATS {
			require.Equal(t, 100, c.OnBroker, "NATS drops the re-sent events by event id")
		} else {
			require.GreaterOrEqual(t, c.OnBroker, 100+c.SentTwice, "the crash's duplicates are on the broker")
			require.GreaterOrEqual(t, c.DuplicatesSkipped, c.SentTwice)
		}
		require.Contains(t, out.String(), "Every committed order reached the broker and was billed exactly once.")
		require.NotContains(t, out.String(), "cleanup:")
		requireGone(t, kind, c.Topic)
	})
}

// requireGone checks on the shared servers that the demo removed its
// topic's topology (Kafka runs in the demo's process and goes with it).
func requireGone(t *testing.T, kind, topic string) {
	t.Helper()
	switch kind {
	case bus.KindRabbitMQ:
		brokertest.RequireQueuesGone(t, "amqp://guest:guest@127.0.0.1:5672/",
			rabbit.QueueName(topic, billing.HandlerName), rabbit.QueueName(topic, tapGroup), rabbit.UnroutedQueueName(topic))
	case bus.KindNATS:
		brokertest.RequireStreamsGone(t, "nats://127.0.0.1:4222", topic)
	}
}

func TestDemoRefusesAHostileSchema(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(path, []byte("broker:\n  nats:\n    url: nats://127.0.0.1:4222\n"), 0o600))
	_, err := run(context.Background(), path, `x"; DROP SCHEMA public CASCADE; --`, 1, &bytes.Buffer{})
	require.ErrorContains(t, err, "database.schema")
}
