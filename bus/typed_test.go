package bus_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/bus/internal/testpb"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// Every declaration mistake is an error of NewTopic naming the type and
// what is wrong, before anything is published.
func TestNewTopicRefusesBadDeclarations(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		err  func() error
		want []string
	}{
		{"no wire name", func() error { _, err := bus.NewTopic[unnamed]("orders"); return err },
			[]string{"bus_test.unnamed", "no wire name", "EventType() string", "bus.TypeName"}},
		{"two wire names", func() error { _, err := bus.NewTopic[placedV2]("orders", bus.TypeName("Placed")); return err },
			[]string{`TypeName("Placed")`, `EventType() "OrderPlaced"`}},
		{"bad wire name", func() error { _, err := bus.NewTopic[unnamed]("orders", bus.TypeName("Order\nPlaced")); return err },
			[]string{"wire name"}},
		{"bad topic", func() error { _, err := bus.NewTopic[placedV2]("orders events"); return err },
			[]string{`"orders events"`, "topic"}},
		{"version 0", func() error { _, err := bus.NewTopic[placedV2]("orders", bus.Version(0)); return err },
			[]string{"version must be at least 1; got 0"}},
		{"unregistered codec", func() error { _, err := bus.NewTopic[placedV2]("orders", bus.WithCodec("avro")); return err },
			[]string{`codec "avro" is not registered`, "json, protobuf", "bus.RegisterCodec"}},
		{"codec cannot encode the type", func() error { _, err := bus.NewTopic[placedV2]("orders", bus.WithCodec(bus.CodecProtobuf)); return err },
			[]string{"codec protobuf cannot encode bus_test.placedV2", "not a protobuf message"}},
		{"JSON cannot encode the type", func() error { _, err := bus.NewTopic[unencodable]("orders"); return err },
			[]string{"codec json cannot encode bus_test.unencodable"}},
		{"missing upcaster", func() error {
			_, err := bus.NewTopic[placedV2]("orders", bus.Version(3), bus.Upcast(1, upcastPlaced))
			return err
		},
			[]string{"no upcaster from version 2"}},
		{"upcaster to the wrong type", func() error {
			_, err := bus.NewTopic[placedV3]("orders", bus.Version(2), bus.Upcast(1, upcastPlaced))
			return err
		}, []string{"upcaster from version 1 returns bus_test.placedV2, but version 2 is read as bus_test.placedV3"}},
		{"upcaster from the topic's version", func() error {
			_, err := bus.NewTopic[placedV2]("orders", bus.Version(1), bus.Upcast(1, upcastPlaced))
			return err
		}, []string{"upcaster from version 1: must read a version from 1 to 0"}},
		{"two upcasters from one version", func() error {
			_, err := bus.NewTopic[placedV2]("orders", bus.Version(2), bus.Upcast(1, upcastPlaced), bus.Upcast(1, upcastPlaced))
			return err
		}, []string{"two upcasters from version 1"}},
		{"nil upcaster", func() error {
			_, err := bus.NewTopic[placedV2]("orders", bus.Version(2), bus.Upcast[placedV1, placedV2](1, nil))
			return err
		}, []string{"upcaster from version 1 is nil"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.err()
			require.Error(t, err)
			require.True(t, containsAll(err.Error(), c.want...), "%v\nshould contain %q", err, c.want)
		})
	}
	require.Panics(t, func() { bus.Must(bus.NewTopic[unnamed]("orders")) })
}

// A codec is registered once under its name; the registry refuses a nil
// codec, a taken name and a content type that is not a media type.
func TestRegisterCodec(t *testing.T) {
	t.Parallel()
	require.ErrorContains(t, bus.RegisterCodec(nil), "codec is nil")
	require.ErrorContains(t, bus.RegisterCodec(namedCodec{name: bus.CodecJSON, contentType: "application/json"}), `"json" is already registered`)
	require.ErrorContains(t, bus.RegisterCodec(namedCodec{name: "broken", contentType: "not a media type"}), "content type")
	name := testdb.UniqueName("codec")
	require.NoError(t, bus.RegisterCodec(namedCodec{name: name, contentType: "application/vnd.test+json"}))
	topic, err := bus.NewTopic[placedV2]("orders", bus.WithCodec(name))
	require.NoError(t, err)
	ev, err := topic.Event(placedV2{OrderID: "o-1", TotalCents: 5})
	require.NoError(t, err)
	require.Equal(t, "application/vnd.test+json", ev.ContentType)
}

// namedCodec is JSON under another name and content type.
type namedCodec struct{ name, contentType string }

func (c namedCodec) Name() string                     { return c.name }
func (c namedCodec) ContentType() string              { return c.contentType }
func (namedCodec) Marshal(v any) ([]byte, error)      { return json.Marshal(v) }
func (namedCodec) Unmarshal(data []byte, v any) error { return json.Unmarshal(data, v) }

// A typed Publish writes the envelope from the declaration: the wire name,
// the schema version, the codec's content type, the aggregate.
func TestTypedPublishWritesTheDeclaredEnvelope(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	placed := bus.Must(bus.NewTopic[placedV2]("orders.events", bus.Version(2), bus.Upcast(1, upcastPlaced)))
	pbTopic := bus.Must(bus.NewTopic[*testpb.OrderPlaced]("orders.pb", bus.WithCodec(bus.CodecProtobuf)))

	tx := tb.begin(t)
	require.NoError(t, placed.Publish(ctx, tb.bus, tx, placedV2{OrderID: "o-1", TotalCents: 4200}, placedV2{OrderID: "o-2", TotalCents: 1}))
	require.NoError(t, pbTopic.Publish(ctx, tb.bus, tx, &testpb.OrderPlaced{OrderId: "o-3", TotalCents: 7, Items: []string{"book"}}))
	require.NoError(t, tx.Commit())

	rows := tb.outbox(t)
	require.Len(t, rows, 3)
	for i, r := range rows[:2] {
		require.Equal(t, "orders.events", r.topic)
		require.Equal(t, "OrderPlaced", r.event.Type)
		require.Equal(t, 2, r.event.SchemaVersion)
		require.Equal(t, "application/json", r.event.ContentType)
		require.Equal(t, "order", r.event.AggregateType)
		require.Equal(t, fmt.Sprintf("o-%d", i+1), r.event.AggregateID)
	}
	require.JSONEq(t, `{"order_id":"o-1","total_cents":4200}`, string(rows[0].event.Payload))
	pb := rows[2]
	require.Equal(t, "orders.pb", pb.topic)
	require.Equal(t, "application/x-protobuf", pb.event.ContentType)
	require.Equal(t, "o-3", pb.event.AggregateID)
	var got testpb.OrderPlaced
	require.NoError(t, proto.Unmarshal(pb.event.Payload, &got))
	require.Equal(t, []string{"book"}, got.GetItems())
}

// A value that cannot be published is refused with its index before
// anything is written; the transaction stays usable.
func TestTypedPublishRefusesBeforeWriting(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	pb := bus.Must(bus.NewTopic[*testpb.OrderPlaced]("orders.pb", bus.WithCodec(bus.CodecProtobuf)))
	bare := bus.Must(bus.NewTopic[noAggregate]("orders.bare"))

	tx := tb.begin(t)
	err := pb.Publish(ctx, tb.bus, tx, &testpb.OrderPlaced{OrderId: "o-1"}, nil)
	var ee *bus.EventError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, 1, ee.Index)
	require.Equal(t, "Value", ee.Field)
	require.ErrorIs(t, err, bus.ErrMissingField)
	require.ErrorContains(t, err, "a nil *testpb.OrderPlaced")

	err = bare.Publish(ctx, tb.bus, tx, noAggregate{N: 1})
	require.ErrorAs(t, err, &ee)
	require.Equal(t, "AggregateID", ee.Field)
	require.ErrorContains(t, err, "no Aggregate() (aggregateType, aggregateID string) method")

	// The escape hatch: the event of a value, with the envelope completed.
	ev, err := bare.Event(noAggregate{N: 2})
	require.NoError(t, err)
	ev.AggregateType, ev.AggregateID, ev.AggregateVersion = "counter", "c-1", 2
	require.NoError(t, tb.bus.Publish(ctx, tx, bare.Name(), ev))
	require.NoError(t, tx.Commit())
	rows := tb.outbox(t)
	require.Len(t, rows, 1, "only the completed event was written")
	require.EqualValues(t, 2, rows[0].event.AggregateVersion)
}

// An Event's ContentType decides how its payload is checked, over
// outbox.codec: a JSON type must hold JSON, any other is carried as is.
func TestEventContentTypeOverridesOutboxCodec(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	ev := orderCreated("o-1")
	ev.Payload, ev.ContentType = []byte{0x08, 0x96, 0x01}, "application/x-protobuf"
	require.NoError(t, tb.bus.PublishInOwnTx(ctx, "orders.events", ev))
	ev.ContentType = "application/vnd.orders+json"
	err := tb.bus.PublishInOwnTx(ctx, "orders.events", ev)
	require.ErrorIs(t, err, bus.ErrInvalidPayload)
	require.ErrorContains(t, err, `not valid JSON (ContentType is "application/vnd.orders+json")`)
	ev.ContentType = "no/such type"
	require.ErrorIs(t, tb.bus.PublishInOwnTx(ctx, "orders.events", ev), bus.ErrInvalidField)
	rows := tb.outbox(t)
	require.Len(t, rows, 1)
	require.Equal(t, "application/x-protobuf", rows[0].event.ContentType)
	require.Equal(t, []byte{0x08, 0x96, 0x01}, rows[0].event.Payload)
}

// Routes are checked when the handler is registered.
func TestHandleTypesRefusesBadRoutes(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	placed := bus.Must(bus.NewTopic[placedV2]("orders.events", bus.Version(2), bus.Upcast(1, upcastPlaced)))
	renamed := bus.Must(bus.NewTopic[placedBeforeRename]("orders.events", bus.Version(2)))
	other := bus.Must(bus.NewTopic[cancelled]("other.events"))
	ok := func(context.Context, bus.Message[placedV2]) error { return nil }
	for _, c := range []struct {
		name   string
		routes []bus.Route
		want   string
	}{
		{"duplicate type name", []bus.Route{bus.On(placed, ok), bus.On(renamed, func(context.Context, bus.Message[placedBeforeRename]) error { return nil })},
			`two routes for event type "OrderPlaced"`},
		{"two topics", []bus.Route{bus.On(placed, ok), bus.On(other, func(context.Context, bus.Message[cancelled]) error { return nil })},
			`is on topic "other.events", the others on "orders.events"`},
		{"nil func", []bus.Route{bus.On[placedV2](placed, nil)}, `route for event type "OrderPlaced": handler func is nil`},
		{"nil topic", []bus.Route{bus.On[placedV2](nil, ok)}, "route for bus_test.placedV2: the topic is nil"},
		{"no routes", nil, "no routes"},
	} {
		err := tb.bus.HandleTypes("billing", c.routes)
		require.ErrorContains(t, err, c.want, c.name)
		require.ErrorContains(t, err, `HandleTypes("billing")`, c.name)
	}
}

// chainWorld drives typed handlers through the real consumer chain without
// a broker, with the poison table and a metrics registry.
type chainWorld struct {
	tb  testBundle
	reg *prometheus.Registry
	ops *ops.Client
}

func newChainWorld(t *testing.T, change ...func(*bus.Config)) chainWorld {
	reg := prometheus.NewRegistry()
	tb := setup(t, change...)
	b, err := bus.Open(context.Background(), tb.cfg, tb.db, bus.WithRegistry(reg))
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	tb.bus = b
	oc, err := ops.New(context.Background(), tb.db, tb.cfg)
	require.NoError(t, err)
	return chainWorld{tb: tb, reg: reg, ops: oc}
}

// chain returns the chain of the typed handler name over routes.
func (w chainWorld) chain(t *testing.T, name string, routes []bus.Route, opts ...bus.HandleOption) message.NoPublishHandlerFunc {
	t.Helper()
	handle, err := w.tb.bus.ConsumerChainTypes(context.Background(), name, routes, nil, opts...)
	require.NoError(t, err)
	return handle
}

// poisonReasons are the reasons of handler's poisoned messages by event id.
func (w chainWorld) poisonReasons(t *testing.T, handler string) map[string]string {
	t.Helper()
	list, err := w.ops.DLQ().List(context.Background(), ops.Filter{Handler: handler}, 0)
	require.NoError(t, err)
	out := map[string]string{}
	for _, m := range list.Rows {
		out[m.EventID] = m.Reason
	}
	return out
}

// counter reads a counter of the Bus's registry with the given labels.
func (w chainWorld) counter(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	return testkit.Metric(t, w.reg, name, labels)
}

// delivered is ev as a broker delivers it after the relay: the envelope in
// metadata.
func delivered(ctx context.Context, id string, ev bus.Event) *message.Message {
	msg := message.NewMessage(id, ev.Payload)
	msg.Metadata = message.Metadata{
		bus.EventIDKey: id, bus.EventTypeKey: ev.Type, bus.AggregateTypeKey: ev.AggregateType,
		bus.AggregateIDKey: ev.AggregateID, bus.SchemaVersionKey: strconv.Itoa(max(ev.SchemaVersion, 1)),
	}
	if ev.ContentType != "" {
		msg.Metadata[bus.ContentTypeKey] = ev.ContentType
	}
	msg.SetContext(ctx)
	return msg
}

func mustEvent[T any](t *testing.T, topic *bus.Topic[T], v T) bus.Event {
	t.Helper()
	ev, err := topic.Event(v)
	require.NoError(t, err)
	return ev
}

// A typed handler gets each event decoded at its version: version 2 as is,
// version 1 upcast, version 3 poisoned naming both versions, a payload that
// does not decode poisoned naming the field or byte, a type it has no route
// for acked without an attempt (the default) or poisoned
// (WithUnknownTypes(PoisonUnknown)), and counted.
func TestTypedHandlerDecodesUpcastsAndPoisons(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newChainWorld(t)
	placed := bus.Must(bus.NewTopic[placedV2]("orders.events", bus.Version(2), bus.Upcast(1, upcastPlaced)))
	placedV1Topic := bus.Must(bus.NewTopic[placedV1]("orders.events"))
	placedV3Topic := bus.Must(bus.NewTopic[placedV3]("orders.events", bus.Version(3)))
	cancel := bus.Must(bus.NewTopic[cancelled]("orders.events"))
	pb := bus.Must(bus.NewTopic[*testpb.OrderPlaced]("orders.events.pb", bus.WithCodec(bus.CodecProtobuf)))

	var got []bus.Message[placedV2]
	var gotCancelled []string
	billing := w.chain(t, "billing", []bus.Route{
		bus.On(placed, func(_ context.Context, m bus.Message[placedV2]) error { got = append(got, m); return nil }),
		bus.On(cancel, func(_ context.Context, m bus.Message[cancelled]) error {
			gotCancelled = append(gotCancelled, m.Value.OrderID)
			return nil
		}),
	}, bus.WithUnknownTypes(bus.PoisonUnknown))
	audited := 0
	audit := w.chain(t, "audit", []bus.Route{bus.On(cancel, func(context.Context, bus.Message[cancelled]) error { audited++; return nil })})
	var gotPB []*testpb.OrderPlaced
	shipping := w.chain(t, "shipping", []bus.Route{bus.On(pb, func(_ context.Context, m bus.Message[*testpb.OrderPlaced]) error {
		gotPB = append(gotPB, m.Value)
		return nil
	})})

	v2 := mustEvent(t, placed, placedV2{OrderID: "o-2", TotalCents: 250})
	v1 := mustEvent(t, placedV1Topic, placedV1{OrderID: "o-1", Total: 12.34})
	v3 := mustEvent(t, placedV3Topic, placedV3{OrderID: "o-3", TotalCents: 1, Currency: "EUR"})
	badField := v2
	badField.Payload = []byte(`{"order_id":"o-4","total_cents":"many"}`)
	wrongCodec := mustEvent(t, pb, &testpb.OrderPlaced{OrderId: "o-5"})
	wrongCodec.Type = "OrderPlaced"
	shipped := bus.Event{Type: "OrderShipped", AggregateType: "order", AggregateID: "o-6", Payload: []byte(`{}`)}
	c7 := mustEvent(t, cancel, cancelled{OrderID: "o-7"})
	for id, ev := range map[string]bus.Event{"e-2": v2, "e-1": v1, "e-3": v3, "e-4": badField, "e-5": wrongCodec, "e-6": shipped, "e-7": c7} {
		require.NoError(t, billing(delivered(ctx, id, ev)), id)
		require.NoError(t, audit(delivered(ctx, id, ev)), id)
	}
	goodPB := mustEvent(t, pb, &testpb.OrderPlaced{OrderId: "o-8", TotalCents: 800, Items: []string{"a", "b"}})
	corruptPB := goodPB
	corruptPB.Payload = []byte{0x0a, 0x01, 'o', 0x12, 0x05} // order_id "o", then total_cents with a wrong wire type, cut short
	require.NoError(t, shipping(delivered(ctx, "e-8", goodPB)))
	require.NoError(t, shipping(delivered(ctx, "e-9", corruptPB)))

	require.Len(t, got, 2)
	byOrder := map[string]bus.Message[placedV2]{}
	for _, m := range got {
		byOrder[m.Value.OrderID] = m
	}
	require.EqualValues(t, 250, byOrder["o-2"].Value.TotalCents)
	require.Equal(t, 2, byOrder["o-2"].SchemaVersion)
	require.EqualValues(t, 1234, byOrder["o-1"].Value.TotalCents, "version 1 upcast to version 2")
	require.Equal(t, 1, byOrder["o-1"].SchemaVersion, "the envelope says what was published")
	require.Equal(t, "e-1", byOrder["o-1"].ID)
	require.Equal(t, []string{"o-7"}, gotCancelled)
	require.Len(t, gotPB, 1)
	require.True(t, proto.Equal(&testpb.OrderPlaced{OrderId: "o-8", TotalCents: 800, Items: []string{"a", "b"}}, gotPB[0]))

	reasons := w.poisonReasons(t, "billing")
	require.Len(t, reasons, 4, "%v", reasons)
	require.True(t, containsAll(reasons["e-3"], "metadata.schema-version", "schema version 3", "version 2"), reasons["e-3"])
	require.True(t, containsAll(reasons["e-4"], "payload.total_cents", "expected int64"), reasons["e-4"])
	require.True(t, containsAll(reasons["e-5"], "content-type", "application/x-protobuf", "codec json"), reasons["e-5"])
	require.True(t, containsAll(reasons["e-6"], `event type "OrderShipped" has no route in handler billing`, "OrderCancelled, OrderPlaced"), reasons["e-6"])
	require.Equal(t, 1, audited)
	requireOtherTypesAcked(t, w, "audit", 6, "billing")
	pbReasons := w.poisonReasons(t, "shipping")
	require.True(t, containsAll(pbReasons["e-9"], "invalid payload.total_cents: event type OrderPlaced version 1 does not decode with codec protobuf",
		"at byte 3, field 2 (total_cents): unexpected EOF"), pbReasons["e-9"])

	unknown := func(handler, typ string) float64 {
		return w.counter(t, bus.MetricUnknownTypes, map[string]string{"handler": handler, "event_type": typ})
	}
	require.EqualValues(t, 1, unknown("billing", "OrderShipped"))
	require.EqualValues(t, 5, unknown("audit", "OrderPlaced"), "e-1 to e-5")
	require.EqualValues(t, 1, unknown("audit", "OrderShipped"))
}

// requireOtherTypesAcked checks that handler acked others events of types it
// has no route for without an attempt (no poison, no inbox row, counted as
// other_type), and that strict, with PoisonUnknown, acked none that way.
func requireOtherTypesAcked(t *testing.T, w chainWorld, handler string, others int, strict string) {
	t.Helper()
	require.Empty(t, w.poisonReasons(t, handler), "%s acks the types it has no route for", handler)
	outcome := func(handler, outcome string) float64 {
		return w.counter(t, middleware.MetricMessages, map[string]string{"handler": handler, "outcome": outcome})
	}
	require.EqualValues(t, others, outcome(handler, middleware.OutcomeOtherType), "acked without an attempt")
	require.Zero(t, outcome(strict, middleware.OutcomeOtherType))
	var inboxRows int
	require.NoError(t, w.tb.db.QueryRow(`SELECT count(*) FROM "`+w.tb.cfg.Database.Schema+`".millrace_inbox WHERE consumer_group = $1`, handler).Scan(&inboxRows))
	require.EqualValues(t, outcome(handler, middleware.OutcomeOK), inboxRows, "no inbox row for the types %s does not take", handler)
}

// bus.Tx in a handler whose inbox and ordering guard are off panics with
// the cause, and the message is poisoned with it at once, not retried.
func TestTxWithoutInboxTransactionIsAClearPermanentFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	off := false
	w := newChainWorld(t, func(c *bus.Config) { c.Consumer.Inbox.Enabled = &off })
	calls := 0
	handle, err := w.tb.bus.ConsumerChain(ctx, "orders.events", "billing", func(ctx context.Context, ev bus.Event) error {
		calls++
		_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `SELECT 1`)
		return err
	}, nil)
	require.NoError(t, err)
	require.NoError(t, handle(delivered(ctx, "e-1", orderCreated("o-1"))), "poisoned, then acked")
	require.Equal(t, 1, calls, "a missing transaction is not retried")
	reason := w.poisonReasons(t, "billing")["e-1"]
	require.True(t, containsAll(reason, "no inbox transaction for bus.Tx[*sql.Tx] while handling event e-1",
		"consumer.inbox.enabled and consumer.ordering_guard are both false"), reason)

	defer func() {
		err, _ := recover().(error)
		require.ErrorIs(t, err, bus.ErrNoTx)
		require.ErrorContains(t, err, "ctx is not the context of a handler")
	}()
	bus.Tx[*sql.Tx](ctx)
}

// A panic other than Tx's stays a retryable failure of the handler.
func TestOtherPanicsInTypedHandlersAreRetried(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newChainWorld(t, func(c *bus.Config) { c.Consumer.Retry.MaxAttempts = 2 })
	placed := bus.Must(bus.NewTopic[placedV2]("orders.events", bus.Version(2)))
	calls := 0
	handle := w.chain(t, "billing", []bus.Route{bus.On(placed, func(context.Context, bus.Message[placedV2]) error {
		calls++
		panic(errors.New("boom"))
	})})
	require.NoError(t, handle(delivered(ctx, "e-1", mustEvent(t, placed, placedV2{OrderID: "o-1"}))))
	require.Equal(t, 2, calls)
	require.Contains(t, w.poisonReasons(t, "billing")["e-1"], "boom")
}
