package forwarder

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/millrace-io/millrace/adapters"
)

const tracerName = "github.com/millrace-io/millrace/forwarder"

// tracing gives each published message a span of the relay in the trace
// its publisher started (read from the message's metadata, which the relay
// sends on unchanged), so one trace covers Publish, the relay and the
// handler.
type tracing struct {
	provider   trace.TracerProvider // nil: the global one, looked up per batch
	propagator propagation.TextMapPropagator
}

func newTracing(tp trace.TracerProvider, p propagation.TextMapPropagator) tracing {
	return tracing{provider: tp, propagator: p}
}

// Propagator is p, else the globally set propagator, else W3C trace
// context and baggage (the global one does nothing until a service sets it).
func Propagator(p propagation.TextMapPropagator) propagation.TextMapPropagator {
	if p != nil {
		return p
	}
	if g := otel.GetTextMapPropagator(); len(g.Fields()) > 0 {
		return g
	}
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// start opens one span per message of a PublishBatch call; the returned
// func ends them with the call's outcome for each message.
func (t tracing) start(ctx context.Context, out []adapters.Outgoing) func(error) {
	tp := t.provider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	tracer := tp.Tracer(tracerName)
	prop := Propagator(t.propagator)
	spans := make([]trace.Span, len(out))
	for i, o := range out {
		mctx := prop.Extract(ctx, propagation.MapCarrier(o.Msg.Metadata))
		_, spans[i] = tracer.Start(mctx, o.Topic+" relay", trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(
				attribute.String("messaging.operation.type", "send"),
				attribute.String("messaging.destination.name", o.Topic),
				attribute.String("messaging.message.id", o.Msg.UUID),
				attribute.Int("messaging.batch.message_count", len(out)),
			))
	}
	return func(err error) {
		var be *adapters.BatchError
		batchErr := errors.As(err, &be) && len(be.Errs) == len(spans)
		for i, span := range spans {
			failed := err
			if batchErr {
				failed = be.Errs[i]
			}
			if failed != nil {
				span.RecordError(failed)
				span.SetStatus(codes.Error, failed.Error())
			}
			span.End()
		}
	}
}
