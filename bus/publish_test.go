package bus_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

type testBundle struct {
	bus    *bus.Bus
	db     *sql.DB
	schema string
	cfg    bus.Config
}

func setup(t *testing.T, change ...func(*bus.Config)) testBundle {
	t.Helper()
	db := testdb.Open(t)
	schema := testdb.Schema(t, db)
	cfg := bus.Config{}
	cfg.Database.Schema = schema
	cfg.Broker.NATS.URL = "nats://127.0.0.1:4222"
	for _, c := range change {
		c(&cfg)
	}
	ctx := context.Background()
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	b, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	return testBundle{bus: b, db: db, schema: schema, cfg: b.Config()}
}

// begin begins a transaction on the bundle's database.
func (tb testBundle) begin(t *testing.T) *sql.Tx {
	t.Helper()
	tx, err := tb.db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	return tx
}

// outboxRow is one row of the outbox table, unwrapped.
type outboxRow struct {
	topic string
	msg   *message.Message
	event bus.Event
}

func (tb testBundle) outbox(t *testing.T) []outboxRow {
	t.Helper()
	rows, err := tb.db.Query(`SELECT payload FROM "` + tb.schema + `"."watermill_millrace_outbox" ORDER BY transaction_id, "offset"`)
	require.NoError(t, err)
	defer rows.Close()
	var out []outboxRow
	for rows.Next() {
		var payload []byte
		require.NoError(t, rows.Scan(&payload))
		topic, msg, err := envelope.Unwrap(payload)
		require.NoError(t, err)
		ev, err := bus.EventFromMessage(msg)
		require.NoError(t, err)
		out = append(out, outboxRow{topic: topic, msg: msg, event: ev})
	}
	require.NoError(t, rows.Err())
	return out
}

func orderCreated(id string) bus.Event {
	return bus.Event{
		Type:             "OrderCreated",
		AggregateType:    "order",
		AggregateID:      id,
		AggregateVersion: 1,
		Payload:          []byte(`{"order_id":"` + id + `","total":4200}`),
	}
}

func TestPublishCommitWritesEnvelope(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()

	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(ctx)
	ctx, span := tp.Tracer("test").Start(ctx, "create order")
	defer span.End()

	tx := tb.begin(t)
	_, err := tx.ExecContext(ctx, `CREATE TABLE "`+tb.schema+`".orders (id text primary key)`)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `INSERT INTO "`+tb.schema+`".orders VALUES ('o-1')`)
	require.NoError(t, err)
	occurred := time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
	ev := orderCreated("o-1")
	ev.SchemaVersion = 2
	ev.OccurredAt = occurred
	ev.CorrelationID = "corr-1"
	ev.CausationID = "cmd-1"
	ev.Metadata = map[string]string{"tenant": "acme"}
	require.NoError(t, tb.bus.Publish(ctx, tx, "orders.events", ev))
	require.Empty(t, tb.outbox(t), "nothing is visible before commit")
	require.NoError(t, tx.Commit())

	rows := tb.outbox(t)
	require.Len(t, rows, 1)
	got := rows[0]
	require.Equal(t, "orders.events", got.topic)
	require.NotEmpty(t, got.event.ID)
	require.Equal(t, got.msg.UUID, got.event.ID, "event id is the Watermill message UUID")
	require.Equal(t, got.event.ID, got.msg.Metadata.Get(bus.EventIDKey))
	require.Equal(t, "OrderCreated", got.event.Type)
	require.Equal(t, "order", got.event.AggregateType)
	require.Equal(t, "o-1", got.event.AggregateID)
	require.EqualValues(t, 1, got.event.AggregateVersion)
	require.Equal(t, 2, got.event.SchemaVersion)
	require.True(t, occurred.Equal(got.event.OccurredAt))
	require.Equal(t, "corr-1", got.event.CorrelationID)
	require.Equal(t, "cmd-1", got.event.CausationID)
	require.Equal(t, "application/json", got.msg.Metadata.Get(bus.ContentTypeKey))
	require.Equal(t, map[string]string{"tenant": "acme"}, got.event.Metadata, "envelope keys are Event fields, not extra metadata")
	require.Contains(t, got.msg.Metadata.Get(bus.TraceparentKey), span.SpanContext().TraceID().String())
	require.JSONEq(t, `{"order_id":"o-1","total":4200}`, string(got.event.Payload))
}

func TestPublishRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tx := tb.begin(t)
	require.NoError(t, tb.bus.Publish(ctx, tx, "orders.events", orderCreated("o-1"), orderCreated("o-2")))
	require.NoError(t, tx.Rollback())
	require.Empty(t, tb.outbox(t))
}

func TestConcurrentPublishingTransactionsLoseNothing(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	// The transactions overlap within the pool's bound; without one, 100
	// connections at once exhaust a server that other tests share.
	tb.db.SetMaxOpenConns(20)
	ctx := context.Background()
	const n = 100
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			tx, err := tb.db.BeginTx(ctx, nil)
			if err != nil {
				errs <- err
				return
			}
			ev := orderCreated("o-" + string(rune('A'+i%26)) + "-" + time.Now().Format("150405.000000000"))
			ev.Metadata = map[string]string{"n": string(rune('0' + i%10))}
			if err := tb.bus.Publish(ctx, tx, "orders.events", ev); err != nil {
				tx.Rollback()
				errs <- err
				return
			}
			errs <- tx.Commit()
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	rows := tb.outbox(t)
	require.Len(t, rows, n)
	ids := map[string]bool{}
	for _, r := range rows {
		ids[r.event.ID] = true
	}
	require.Len(t, ids, n, "every event has its own id")
}

func TestPublishLargeBatchInOneTransaction(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	events := make([]bus.Event, 2500) // more than one INSERT statement's worth
	for i := range events {
		events[i] = orderCreated("o-batch")
		events[i].AggregateVersion = int64(i + 1)
	}
	require.NoError(t, tb.bus.PublishInOwnTx(ctx, "orders.events", events...))
	rows := tb.outbox(t)
	require.Len(t, rows, len(events))
	for i, r := range rows {
		require.EqualValues(t, i+1, r.event.AggregateVersion, "rows keep the order they were published in")
	}
}

func TestRowWrittenByWatermillForwarderIsAMillraceEvent(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	// Plain Watermill: the stock forwarder publisher, pointed at millrace's
	// outbox topic, over an SQL publisher.
	msg := message.NewMessage("6f1c1b2e-5a0e-4c55-9a59-8f0a3c1d2e4f", []byte(`{"legacy":true}`))
	msg.Metadata.Set(bus.EventTypeKey, "LegacyHappened")
	msg.Metadata.Set(bus.AggregateIDKey, "l-1")
	msg.Metadata.Set(bus.AggregateVersionKey, "7")
	msg.Metadata.Set("x-custom", "kept")
	brokertest.WriteOutboxWithWatermill(t, tb.db, tb.cfg, "legacy.events", msg)
	bare := message.NewMessage("0b7d7e8e-2f5d-4a3e-8c61-3c2d1e0f9a8b", []byte(`{}`))
	brokertest.WriteOutboxWithWatermill(t, tb.db, tb.cfg, "legacy.events", bare)

	rows := tb.outbox(t)
	require.Len(t, rows, 2)
	require.Equal(t, "legacy.events", rows[0].topic)
	require.Equal(t, "6f1c1b2e-5a0e-4c55-9a59-8f0a3c1d2e4f", rows[0].event.ID)
	require.Equal(t, "LegacyHappened", rows[0].event.Type)
	require.Equal(t, "l-1", rows[0].event.AggregateID)
	require.EqualValues(t, 7, rows[0].event.AggregateVersion)
	require.Equal(t, map[string]string{"x-custom": "kept"}, rows[0].event.Metadata)
	require.JSONEq(t, `{"legacy":true}`, string(rows[0].event.Payload))
	require.Equal(t, "0b7d7e8e-2f5d-4a3e-8c61-3c2d1e0f9a8b", rows[1].event.ID, "a bare Watermill message keeps its UUID as event id")
}

func TestEnvelopeMatchesWatermillForwarderFormat(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	require.NoError(t, tb.bus.PublishInOwnTx(ctx, "orders.events", orderCreated("o-1")))
	var payload []byte
	require.NoError(t, tb.db.QueryRow(`SELECT payload FROM "`+tb.schema+`"."watermill_millrace_outbox"`).Scan(&payload))
	var fields map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(payload, &fields))
	keys := make([]string, 0, len(fields))
	for k := range fields {
		keys = append(keys, k)
	}
	require.ElementsMatch(t, []string{"destination_topic", "uuid", "payload", "metadata"}, keys)
}

func TestBadInputIsRefusedAndWritesNothing(t *testing.T) {
	t.Parallel()
	tb := setup(t, func(c *bus.Config) {
		c.Outbox.MaxPayloadBytes = 64
		c.Outbox.MaxMetadataBytes = 512
	})
	ctx := context.Background()
	big := orderCreated("o-1")
	big.Payload = []byte(`{"blob":"` + strings.Repeat("x", 100) + `"}`)
	bigMeta := orderCreated("o-1")
	bigMeta.Metadata = map[string]string{"note": strings.Repeat("x", 600)}
	notJSON := orderCreated("o-1")
	notJSON.Payload = []byte(`{"order_id":`)
	noType := orderCreated("o-1")
	noType.Type = ""
	noAggregate := orderCreated("o-1")
	noAggregate.AggregateID = ""
	reserved := orderCreated("o-1")
	reserved.Metadata = map[string]string{bus.EventIDKey: "forged"}

	cases := []struct {
		name   string
		topic  string
		events []bus.Event
		want   error
		field  string
	}{
		{"empty topic", "", []bus.Event{orderCreated("o-1")}, bus.ErrInvalidTopic, ""},
		{"hostile topic", "orders; DROP TABLE x", []bus.Event{orderCreated("o-1")}, bus.ErrInvalidTopic, ""},
		{"payload not JSON", "orders", []bus.Event{orderCreated("o-0"), notJSON}, bus.ErrInvalidPayload, "Payload"},
		{"payload too large", "orders", []bus.Event{big}, bus.ErrPayloadTooLarge, "Payload"},
		{"metadata too large", "orders", []bus.Event{bigMeta}, bus.ErrMetadataTooLarge, "Metadata"},
		{"missing type", "orders", []bus.Event{noType}, bus.ErrMissingField, "Type"},
		{"missing aggregate id", "orders", []bus.Event{noAggregate}, bus.ErrMissingField, "AggregateID"},
		{"reserved metadata key", "orders", []bus.Event{reserved}, bus.ErrInvalidField, "Metadata"},
	}
	for _, tc := range cases {
		tx := tb.begin(t)
		err := tb.bus.Publish(ctx, tx, tc.topic, tc.events...)
		require.ErrorIs(t, err, tc.want, tc.name)
		if tc.field != "" {
			var ee *bus.EventError
			require.ErrorAs(t, err, &ee, tc.name)
			require.Equal(t, tc.field, ee.Field, tc.name)
			require.Equal(t, len(tc.events)-1, ee.Index, tc.name)
		}
		require.NoError(t, tx.Commit(), "the caller's transaction is still usable after %s", tc.name)
	}

	require.ErrorIs(t, tb.bus.Publish(ctx, nil, "orders", orderCreated("o-1")), bus.ErrNilTx)
	var none *sql.Tx
	require.ErrorIs(t, tb.bus.Publish(ctx, none, "orders", orderCreated("o-1")), bus.ErrNilTx, "a nil *sql.Tx in the Execer")

	committed, err := tb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, committed.Commit())
	err = tb.bus.Publish(ctx, committed, "orders", orderCreated("o-1"))
	require.True(t, errors.Is(err, sql.ErrTxDone), "closed tx: %v", err)

	require.Empty(t, tb.outbox(t), "no bad input wrote anything")
}

func TestPublishHonoursCancelledContext(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	tx, err := tb.db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	cancel()
	require.ErrorIs(t, tb.bus.Publish(ctx, tx, "orders", orderCreated("o-1")), context.Canceled)
	require.NoError(t, tx.Commit())
	require.Empty(t, tb.outbox(t))
}

func TestOpenRefusesMissingOutboxTable(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	cfg := bus.Config{}
	cfg.Database.Schema = testdb.Schema(t, db)
	cfg.Broker.NATS.URL = "nats://127.0.0.1:4222"
	_, err := bus.Open(context.Background(), cfg, db)
	require.ErrorContains(t, err, "does not exist: run `millrace migrate`")
}

func TestOpenNamesUnreachableDatabase(t *testing.T) {
	t.Parallel()
	cfg := bus.Config{}
	cfg.Database.URL = "postgres://app:hunter2@127.0.0.1:1/app?connect_timeout=1"
	cfg.Database.ConnectTimeout = 2 * time.Second
	cfg.Broker.NATS.URL = "nats://127.0.0.1:4222"
	_, err := bus.Open[*sql.DB](context.Background(), cfg, nil)
	require.ErrorContains(t, err, "127.0.0.1:1")
	require.NotContains(t, err.Error(), "hunter2")
}

func TestMigrateIsIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	cfg := bus.Config{}
	cfg.Database.Schema = testdb.SchemaName(t, db, t.Name())
	cfg.Broker.NATS.URL = "nats://127.0.0.1:4222"
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() { errs <- bus.Migrate(context.Background(), db, cfg) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, bus.Migrate(context.Background(), db, cfg), "a second run changes nothing")
	var triggers int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_trigger WHERE tgname = 'millrace_notify_outbox'
		AND tgrelid = ('"'||$1||'"."watermill_millrace_outbox"')::regclass`, cfg.Database.Schema).Scan(&triggers))
	require.Equal(t, 1, triggers)
}

func TestCommitNotifiesTheRelayChannel(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	conn, err := tb.db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(ctx, `LISTEN millrace_outbox`)
	require.NoError(t, err)

	require.NoError(t, tb.bus.PublishInOwnTx(ctx, "orders", orderCreated("o-1"), orderCreated("o-2")))

	// The channel is shared by every outbox of the database; other tests'
	// outboxes notify on it too. The payload says which outbox it is.
	ours := tb.schema + ".watermill_millrace_outbox"
	var note *pgconn.Notification
	require.NoError(t, conn.Raw(func(dc any) error {
		waitCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for note == nil || note.Payload != ours {
			if note, err = dc.(*stdlib.Conn).Conn().WaitForNotification(waitCtx); err != nil {
				return err
			}
		}
		return nil
	}))
	require.Equal(t, "millrace_outbox", note.Channel)
}

func FuzzEventFromMessage(f *testing.F) {
	f.Add("id", "7", "2", "2026-01-02T03:04:05Z", []byte(`{}`))
	f.Add("", "x", "", "yesterday", []byte(nil))
	f.Fuzz(func(t *testing.T, id, version, schema, occurred string, payload []byte) {
		msg := message.NewMessage(id, payload)
		msg.Metadata.Set(bus.AggregateVersionKey, version)
		msg.Metadata.Set(bus.SchemaVersionKey, schema)
		msg.Metadata.Set(bus.OccurredAtKey, occurred)
		ev, err := bus.EventFromMessage(msg)
		if err != nil {
			return // malformed fields are reported, never a panic
		}
		if ev.ID == "" && id != "" {
			t.Fatalf("lost the message UUID %q", id)
		}
	})
}

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

// With outbox.cloudevents on, every event reaches the broker with the
// CloudEvents binary-mode attributes as headers under the prefix of that
// broker's binding; a plain JetStream consumer, no millrace in it, reads
// them on NATS.
func TestCloudEventsAttributesReachTheBroker(t *testing.T) {
	t.Parallel()
	prefixes := map[string]string{bus.KindKafka: "ce_", bus.KindNATS: "ce-", bus.KindRabbitMQ: "cloudEvents_"}
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			svc := brokertest.NewService(t, kind, func(cfg *bus.Config) {
				cfg.Outbox.CloudEvents = bus.CloudEventsConfig{Enabled: true, Source: "/services/orders"}
			})
			cfg := svc.Config
			topic := "ce-_" + testkit.Suffix()
			brokertest.Cleanup(t, kind, topic, "tap")
			b := svc.Open(t)
			prefix := prefixes[kind]

			ev := orderCreated("o-1")
			ev.ID = "evt-ce-1"
			ev.OccurredAt = time.Date(2026, 5, 6, 7, 8, 9, 10, time.UTC)
			refused := ev
			refused.Metadata = map[string]string{prefix + "subject": "mine"}
			err := b.PublishInOwnTx(ctx, topic, refused)
			require.ErrorIs(t, err, bus.ErrInvalidField)
			require.ErrorContains(t, err, "hold CloudEvents attributes")

			msgs := brokertest.Tap(t, cfg, topic, "tap")

			running := testkit.Start(t, b.Run)
			defer func() { require.NoError(t, running.Stop(t, time.Minute)) }()
			require.NoError(t, b.PublishInOwnTx(ctx, topic, ev))

			want := map[string]string{
				prefix + "id": "evt-ce-1", prefix + "type": "OrderCreated", prefix + "source": "/services/orders",
				prefix + "specversion": "1.0", prefix + "time": "2026-05-06T07:08:09.00000001Z",
				"content-type": "application/json",
			}
			select {
			case m := <-msgs:
				for k, v := range want {
					require.Equal(t, v, m.Metadata.Get(k), "%s header %s", kind, k)
				}
				m.Ack()
			case <-time.After(60 * time.Second):
				t.Fatalf("%s: the event did not arrive", kind)
			}

			if kind == bus.KindNATS {
				js := brokertest.NATSJetStream(t, cfg.Broker.NATS.URL)
				stream, err := js.Stream(ctx, nats.StreamName(topic))
				require.NoError(t, err)
				raw, err := stream.GetMsg(ctx, 1)
				require.NoError(t, err)
				for k, v := range want {
					require.Equal(t, v, raw.Header.Get(k), "NATS header %s as a plain client reads it", k)
				}
			}
		})
	}
}

// outbox.cloudevents.source is required when CloudEvents are on, and
// pointless when they are off.
func TestCloudEventsConfig(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		yaml, want string
	}{
		{"outbox:\n  cloudevents:\n    enabled: true\n", "outbox.cloudevents.source: required when outbox.cloudevents.enabled is true"},
		{"outbox:\n  cloudevents:\n    enabled: true\n    source: \"a b\"\n", `outbox.cloudevents.source: must be a URI reference`},
		{"outbox:\n  cloudevents:\n    source: /services/orders\n", "outbox.cloudevents.source: set while outbox.cloudevents.enabled is false"},
	} {
		_, err := bus.ParseConfig([]byte(c.yaml))
		require.ErrorContains(t, err, c.want)
	}
	cfg, err := bus.ParseConfig([]byte("outbox:\n  cloudevents:\n    enabled: true\n    source: urn:example:orders\n"))
	require.NoError(t, err)
	require.Equal(t, "urn:example:orders", cfg.Outbox.CloudEvents.Source)
}
