package forwarder_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// badRow is an outbox row no broker of a kind can take as it is, written by
// plain Watermill (bus.Publish refuses it), and a fragment of the reason the
// relay must quarantine it with.
type badRow struct {
	topic  string
	msg    *message.Message
	reason string
}

// badRows are the rows of each class the relay must set aside on kind.
func badRows(kind, topic string) []badRow {
	msg := func(meta map[string]string, payload []byte) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), payload)
		for k, v := range meta {
			m.Metadata.Set(k, v)
		}
		return m
	}
	rows := []badRow{
		{topic, msg(map[string]string{"_watermill_message_uuid": "forged"}, []byte(`{}`)), "_watermill_message_uuid"},
	}
	switch kind {
	case bus.KindNATS:
		rows = append(rows,
			badRow{topic + "..x", msg(nil, []byte(`{"a":1}`)), "empty token"},
			badRow{topic + ".", msg(nil, []byte(`{"a":22}`)), "empty token"},
			badRow{topic, msg(map[string]string{"bad key": "v"}, []byte(`{}`)), "bad key"},
			badRow{topic, msg(map[string]string{"Nats-Rollup": "all"}, []byte(`{}`)), "Nats-Rollup"},
		)
	case bus.KindRabbitMQ:
		rows = append(rows,
			badRow{topic, msg(map[string]string{"x-death": "[]"}, []byte(`{}`)), "x-death"},
			badRow{topic + "." + strings.Repeat("l", 246-len(topic)-1), msg(nil, []byte(`{"a":1}`)), "too long"}, // 246 bytes: its parking queue would be 256
			badRow{topic, msg(map[string]string{"BCC": "other"}, []byte(`{}`)), "BCC"},
		)
	case bus.KindKafka:
		rows = append(rows, badRow{topic, msg(nil, []byte(`"`+strings.Repeat("p", 1100_000)+`"`)), "max_message_bytes"})
	}
	return rows
}

// One row that can never be published, among 1,000 good ones, on each
// broker: it is quarantined with its reason, and the 1,000 arrive.
func TestRowsNoBrokerCanTakeAreQuarantinedAndTheRestFlow(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testQuarantine)
}

func testQuarantine(t *testing.T, kind string) {
	ctx := context.Background()
	e := newEndToEnd(t, kind, "quarantine")
	bad := badRows(kind, e.topic)
	const good = 1000
	for i := range good {
		// The bad rows sit among the good ones: at the start, the middle and the end.
		if j := i * len(bad) / good; i%(good/len(bad)) == 0 && j < len(bad) {
			brokertest.WriteOutboxWithWatermill(t, e.db, e.cfg, bad[j].topic, bad[j].msg)
		}
		require.NoError(t, e.bus.PublishInOwnTx(ctx, e.topic, bus.Event{
			Type: "Good", AggregateType: "thing", AggregateID: fmt.Sprintf("agg-%d", i%20), AggregateVersion: int64(i/20 + 1),
			Payload: []byte(`{}`),
		}))
	}

	cfg := crashConfig()
	f, err := forwarder.New(e.db, e.broker, forwarder.Outbox{Schema: e.cfg.Database.Schema, Topic: e.cfg.Outbox.Topic}, cfg, forwarder.Options{})
	require.NoError(t, err)
	running := testkit.Start(t, f.Run)
	defer func() { require.NoError(t, running.Stop(t, time.Minute)) }()

	testkit.Eventually(t, waitLimit, "the good rows at the consumer", func() bool { return e.got.distinct() >= good })
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })
	require.Equal(t, good, e.got.distinct(), "only the good rows reached the broker")

	reasons := testdb.Column[string](t, e.db, `SELECT reason FROM "`+e.cfg.Database.Schema+`".millrace_relay_quarantine ORDER BY id`)
	require.Len(t, reasons, len(bad), "every bad row, and only they, quarantined: %q", reasons)
	for i, b := range bad {
		require.Contains(t, reasons[i], b.reason, "row %d's reason names what is wrong", i)
	}
}
