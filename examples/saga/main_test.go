package main

import (
	"bytes"
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/adapters/rabbit"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// The example runs end to end on every broker, against the local
// PostgreSQL, in a schema and on topics of its own: the order that goes
// through is notified, the one without stock refunded, the unpaid one
// cancelled by its timeout; each command was sent once; and the topology
// the run created is gone from the broker.
func TestSagaExampleRuns(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, func(t *testing.T, kind string) {
		db := testdb.Open(t)
		cfg, err := bus.LoadConfig("config.yaml")
		require.NoError(t, err)
		brokertest.Apply(t, kind, &cfg)
		cfg.Database.Schema = testdb.Schema(t, db)
		prefix := "shop-" + testkit.Suffix()

		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		var out bytes.Buffer
		require.NoError(t, run(ctx, cfg, prefix, time.Second, &out))
		require.Regexp(t, `^ord-[0-9a-f]{8}-ok: shipped \(placed; payment requested -> paid; stock requested -> stock reserved; customer notified\)
ord-[0-9a-f]{8}-nostock: refunded \(placed; payment requested -> paid; stock requested -> no stock; payment refunded\)
ord-[0-9a-f]{8}-unpaid: cancelled \(placed; payment requested -> payment timed out; order cancelled\)
$`, out.String())
		require.Equal(t, map[string]int{"ChargePayment": 3, "ReserveStock": 2, "NotifyCustomer": 1, "RefundPayment": 1, "CancelOrder": 1},
			commandsSent(t, db, cfg.Database.Schema, prefix+".commands"))
		requireTopologyGone(t, kind, cfg, prefix)
	})
}

// commandsSent counts the outbox rows of topic by event type.
func commandsSent(t *testing.T, db *sql.DB, schema, topic string) map[string]int {
	commands := map[string]int{}
	rows, err := db.Query(`SELECT payload FROM "` + schema + `".watermill_millrace_outbox`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var payload []byte
		require.NoError(t, rows.Scan(&payload))
		got, msg, err := envelope.Unwrap(payload)
		require.NoError(t, err)
		if got == topic {
			commands[msg.Metadata.Get(bus.EventTypeKey)]++
		}
	}
	require.NoError(t, rows.Err())
	return commands
}

// requireTopologyGone checks on the broker that the run deleted the
// streams, queues or topics it created.
func requireTopologyGone(t *testing.T, kind string, cfg bus.Config, prefix string) {
	t.Helper()
	ctx := context.Background()
	topics := []string{prefix + ".orders", prefix + ".payments", prefix + ".inventory", prefix + ".order-timeouts", prefix + ".commands"}
	switch kind {
	case bus.KindKafka:
		cl, err := kgo.NewClient(kgo.SeedBrokers(cfg.Broker.Kafka.Brokers...))
		require.NoError(t, err)
		defer cl.Close()
		listed, err := kadm.NewClient(cl).ListTopics(ctx, topics...)
		require.NoError(t, err)
		for _, topic := range topics {
			require.False(t, listed.Has(topic), "topic %s is gone", topic)
		}
	case bus.KindRabbitMQ:
		queues := []string{rabbit.QueueName(prefix+".commands", prefix+"-payments"), rabbit.QueueName(prefix+".commands", prefix+"-inventory")}
		for _, topic := range topics[:4] {
			queues = append(queues, rabbit.QueueName(topic, prefix+"-order-process."+topic))
		}
		brokertest.RequireQueuesGone(t, cfg.Broker.RabbitMQ.URL, queues...)
	case bus.KindNATS:
		brokertest.RequireStreamsGone(t, cfg.Broker.NATS.URL, topics...)
	}
}
