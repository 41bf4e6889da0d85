package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/brokertest"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testdb"
)

// The example runs end to end against the local PostgreSQL and NATS, in a
// schema and on topics of its own: the order that goes through is
// notified, the one without stock refunded, the unpaid one cancelled by
// its timeout; each command was sent once.
func TestSagaExampleRuns(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	cfg, err := bus.LoadConfig("config.yaml")
	require.NoError(t, err)
	cfg.Database.Schema = testdb.Schema(t, db)
	prefix := "shop-" + testdb.UniqueName("")[3:]
	for _, topic := range []string{".orders", ".payments", ".inventory", ".order-timeouts"} {
		brokertest.Cleanup(t, bus.KindNATS, prefix+topic, prefix+"-order-process."+prefix+topic)
	}
	brokertest.Cleanup(t, bus.KindNATS, prefix+".commands", prefix+"-payments", prefix+"-inventory")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	require.NoError(t, run(ctx, cfg, prefix, time.Second, &out))
	require.Regexp(t, `^ord-[0-9a-f]{8}-ok: shipped \(placed; payment requested -> paid; stock requested -> stock reserved; customer notified\)
ord-[0-9a-f]{8}-nostock: refunded \(placed; payment requested -> paid; stock requested -> no stock; payment refunded\)
ord-[0-9a-f]{8}-unpaid: cancelled \(placed; payment requested -> payment timed out; order cancelled\)
$`, out.String())

	commands := map[string]int{}
	rows, err := db.Query(`SELECT payload FROM "` + cfg.Database.Schema + `".watermill_millrace_outbox`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var payload []byte
		require.NoError(t, rows.Scan(&payload))
		topic, msg, err := envelope.Unwrap(payload)
		require.NoError(t, err)
		if topic == prefix+".commands" {
			commands[msg.Metadata.Get(bus.EventTypeKey)]++
		}
	}
	require.NoError(t, rows.Err())
	require.Equal(t, map[string]int{"ChargePayment": 3, "ReserveStock": 2, "NotifyCustomer": 1, "RefundPayment": 1, "CancelOrder": 1}, commands)
}
