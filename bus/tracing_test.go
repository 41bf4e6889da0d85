package bus_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/baggage"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
)

// One trace covers Publish, the relay and the handler: a producer span at
// Publish, a relay span per message and the handler's consumer span, all
// with the caller's trace id; baggage set before Publish reaches the
// handler. No global propagator is set, so this is the default one (W3C
// trace context and baggage).
func TestOneTraceAcrossPublishRelayAndHandler(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	svc := brokertest.NewService(t, bus.KindNATS)
	cfg := svc.Config
	exporter := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	defer tp.Shutdown(ctx)
	b := svc.Open(t, bus.WithTracerProvider(tp))
	topic := "trace-" + cfg.Database.Schema[len(cfg.Database.Schema)-8:]
	brokertest.Cleanup(t, bus.KindNATS, topic, "trace-handler")

	type seen struct {
		tenant string
		span   trace.SpanContext
	}
	handled := make(chan seen, 1)
	require.NoError(t, b.Handle(topic, "trace-handler", func(ctx context.Context, ev bus.Event) error {
		require.NotContains(t, ev.Metadata, bus.BaggageKey, "propagation headers are not the event's metadata")
		handled <- seen{baggage.FromContext(ctx).Member("tenant").Value(), trace.SpanContextFromContext(ctx)}
		return nil
	}))
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go b.Run(runCtx)

	member, err := baggage.NewMember("tenant", "acme")
	require.NoError(t, err)
	bag, err := baggage.New(member)
	require.NoError(t, err)
	reqCtx, request := tp.Tracer("test").Start(baggage.ContextWithBaggage(ctx, bag), "request")
	ev := bus.Event{Type: "Traced", AggregateType: "a", AggregateID: "1", Payload: []byte(`{}`)}
	refused := ev
	refused.Metadata = map[string]string{bus.BaggageKey: "x=y"}
	var ee *bus.EventError
	require.True(t, errors.As(b.PublishInOwnTx(reqCtx, topic, refused), &ee), "the propagator's keys are not the caller's")
	require.Equal(t, bus.BaggageKey, ee.Key)
	require.NoError(t, b.PublishInOwnTx(reqCtx, topic, ev))
	request.End()
	traceID := request.SpanContext().TraceID()

	var got seen
	select {
	case got = <-handled:
	case <-time.After(60 * time.Second):
		t.Fatal("the event was not handled")
	}
	require.Equal(t, "acme", got.tenant, "baggage set before Publish is visible in the handler")
	require.Equal(t, traceID, got.span.TraceID())

	byName := map[string]tracetest.SpanStub{}
	require.Eventually(t, func() bool {
		for _, s := range exporter.GetSpans() {
			byName[s.Name] = s
		}
		_, done := byName[topic+" process"]
		return done
	}, 30*time.Second, 20*time.Millisecond, "the consumer span ends")
	publish, relay, process := byName[topic+" publish"], byName[topic+" relay"], byName[topic+" process"]
	require.Equal(t, trace.SpanKindProducer, publish.SpanKind)
	require.Equal(t, trace.SpanKindProducer, relay.SpanKind)
	require.Equal(t, trace.SpanKindConsumer, process.SpanKind)
	for name, s := range map[string]tracetest.SpanStub{"publish": publish, "relay": relay, "process": process} {
		require.Equal(t, traceID, s.SpanContext.TraceID(), "%s span in the caller's trace", name)
	}
	require.Equal(t, request.SpanContext().SpanID(), publish.Parent.SpanID(), "Publish runs in the caller's span")
	require.Equal(t, publish.SpanContext.SpanID(), relay.Parent.SpanID(), "the relay continues the publisher's span")
	require.Equal(t, publish.SpanContext.SpanID(), process.Parent.SpanID(), "the handler continues it through the broker")
	require.Equal(t, got.span.SpanID(), process.SpanContext.SpanID(), "the handler runs in the consumer span")
}
