package bus_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// FuzzPublishRoundTrip publishes arbitrary events for every broker kind and
// reads the outbox row back inside the same transaction: Publish either
// refuses the event with a typed error and writes nothing, or the row holds
// the event byte for byte (ids, aggregate, metadata, payload), and the
// broker's Rules accept the message the relay will send.
func FuzzPublishRoundTrip(f *testing.F) {
	f.Add("", "OrderCreated", "order", "o-1", "", "note", "v", []byte(`{"a":1}`), int64(1), uint8(0))
	f.Add("id\rA", "T", "a", "1", "corr", "my key", " lead", []byte(`{}`), int64(0), uint8(1))
	f.Add("id A", "T\x00", "a", "1\xff", "", "x-death", "a\r\nb", []byte(`"x"`), int64(-5), uint8(2))
	f.Add(" id", "T", "ключ", "🙂", "=?utf-8?b?eA==?=", "Nats-Msg-Id", "\x00", []byte(`[`), int64(9_999_999_999), uint8(0))
	f.Add("e\xc3", "T", "a", "1", "", "_watermill_message_uuid", "=?utf-8?b?Zm9v?=", []byte(`null`), int64(3), uint8(1))
	f.Add("x", "T", "a", "b", "c", "replay-of", "", []byte(`1`), int64(-62135596801), uint8(2))

	ctx := context.Background()
	db := testdb.Open(f)
	schema := testdb.Schema(f, db)
	buses := make([]*bus.Bus, len(brokertest.Kinds))
	for i, kind := range brokertest.Kinds {
		var cfg bus.Config
		cfg.Database.Schema = schema
		cfg.Broker.Kind = kind // the rules come from the config; nothing connects to a broker
		require.NoError(f, bus.Migrate(ctx, db, cfg))
		b, err := bus.Open(ctx, cfg, db)
		require.NoError(f, err)
		f.Cleanup(func() { b.Close() })
		buses[i] = b
	}
	outbox := `"` + schema + `".watermill_millrace_outbox`

	f.Fuzz(func(t *testing.T, id, typ, aggType, aggID, corr, key, value string, payload []byte, unixSeconds int64, kind uint8) {
		b := buses[int(kind)%len(buses)]
		ev := bus.Event{
			ID: id, Type: typ, AggregateType: aggType, AggregateID: aggID, CorrelationID: corr,
			Payload: payload, OccurredAt: time.Unix(unixSeconds, 0),
		}
		if key != "" || value != "" {
			ev.Metadata = map[string]string{key: value}
		}
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer tx.Rollback()
		err = b.Publish(ctx, tx, "fuzz.events", ev)
		var rows int
		require.NoError(t, tx.QueryRowContext(ctx, `SELECT count(*) FROM `+outbox).Scan(&rows))
		if err != nil {
			var ee *bus.EventError
			require.True(t, errors.As(err, &ee), "a refusal is an *EventError: %v", err)
			require.NotEmpty(t, ee.Field, "the error names the field: %v", err)
			require.Zero(t, rows, "a refused event wrote nothing")
			return
		}
		require.Equal(t, 1, rows)
		var raw []byte
		require.NoError(t, tx.QueryRowContext(ctx, `SELECT payload FROM `+outbox).Scan(&raw))
		topic, msg, err := envelope.Unwrap(raw)
		require.NoError(t, err)
		require.Equal(t, "fuzz.events", topic)
		got, err := bus.EventFromMessage(msg)
		require.NoError(t, err, "a row Publish wrote is readable")
		if id != "" {
			require.Equal(t, id, got.ID)
			require.Equal(t, id, msg.UUID)
		}
		require.Equal(t, typ, got.Type)
		require.Equal(t, aggType, got.AggregateType)
		require.Equal(t, aggID, got.AggregateID)
		require.Equal(t, corr, got.CorrelationID)
		require.Equal(t, []byte(payload), []byte(got.Payload))
		require.True(t, ev.OccurredAt.Equal(got.OccurredAt), "occurred at %s, got %s", ev.OccurredAt, got.OccurredAt)
		for k, v := range ev.Metadata {
			require.Equal(t, v, got.Metadata[k], "metadata %q", k)
		}
		require.NoError(t, b.Config().Broker.Rules().CheckMessage(topic, msg), "the broker carries what Publish accepted")
	})
}
