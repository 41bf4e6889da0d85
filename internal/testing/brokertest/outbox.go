package brokertest

import (
	"database/sql"
	"testing"

	watermillsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wmforwarder "github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
)

// WriteOutboxWithWatermill commits msg for topic into cfg's outbox in db
// with Watermill's own forwarder publisher, as a writer other than
// Publish does (it checks nothing).
func WriteOutboxWithWatermill(t *testing.T, db *sql.DB, cfg bus.Config, topic string, msg *message.Message) {
	t.Helper()
	tx, err := db.Begin()
	require.NoError(t, err)
	sqlPub, err := watermillsql.NewPublisher(tx, watermillsql.PublisherConfig{
		SchemaAdapter: watermillsql.DefaultPostgreSQLSchema{
			GenerateMessagesTableName: func(topic string) string { return `"` + cfg.Database.Schema + `"."watermill_` + topic + `"` },
		},
	}, nil)
	require.NoError(t, err)
	require.NoError(t, wmforwarder.NewPublisher(sqlPub, wmforwarder.PublisherConfig{ForwarderTopic: cfg.WithDefaults().Outbox.Topic}).Publish(topic, msg))
	require.NoError(t, tx.Commit())
}

// NATSJetStream connects to the NATS server at url, closed when t ends.
func NATSJetStream(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := natsgo.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return js
}
