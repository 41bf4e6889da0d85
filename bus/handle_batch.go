package bus

import (
	"context"
	"errors"
	"fmt"
	"maps"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/middleware"
)

// BatchHandlerFunc processes the events of one batch together, in one inbox
// transaction: do the business writes of all of them in Tx, say one bulk insert or one call to another service. The
// events are in delivery order (an ordered handler's batch holds at most one
// event per aggregate), each with its inbox row inserted in that
// transaction; redeliveries of events already processed never reach it.
//
// Returning nil commits the batch, and then acks its events. Returning
// BatchFailures fails the events it names by ID: the transaction is rolled
// back, each named event is retried with backoff (poisoned when its error
// is Permanent or its retries run out), and the others are handed over
// again at once in a later batch without them. Any other error fails every
// event of the batch (each retried, or poisoned when the error is
// Permanent). Failing an ID the batch does not hold fails the whole batch
// with an *UnknownBatchMessageError naming it. A panic rolls the batch back,
// and each of its events is tried again in a batch of its own, so that the
// one that panics is retried alone and the others commit.
//
// Batches form as consumer.batch configures them (max_messages, max_wait);
// with max_messages 1 every batch holds one event. Events published with
// Publish(ctx, Tx[Execer](ctx), ...) get no causation: a batch has no single event
// that caused them.
type BatchHandlerFunc func(ctx context.Context, evs []Event) error

// BatchFailures is what a batch handler returns to fail some events of its
// batch and not the others: event ID -> its error (see BatchHandlerFunc).
type BatchFailures = middleware.BatchFailures

// UnknownBatchMessageError is the error of every event of a batch whose
// handler failed an event ID the batch does not hold.
type UnknownBatchMessageError = middleware.UnknownBatchMessageError

// HandleBatch registers fn as a batch handler consuming topic under the
// handler name name: as Handle, with fn called once per batch of events
// (see BatchHandlerFunc). A payload fn cannot take (an invalid envelope) is
// poisoned without reaching it.
func (b *Bus) HandleBatch(topic, name string, fn BatchHandlerFunc, opts ...HandleOption) error {
	spec := handlerSpec{topic: topic, name: name}
	if fn != nil {
		spec.batch = func(ctx context.Context, evs []Event, _ []arrival) error { return fn(ctx, evs) }
	}
	spec, errs := newHandlerSpec(spec, opts)
	return b.register(spec, errs, "HandleBatch")
}

// HandleBatch registers fn as a batch handler of the topic's events under
// handler name name, like Bus.HandleBatch, with each event decoded into a T.
// An event that does not decode (see On) is poisoned without reaching fn;
// an event of another type follows WithUnknownTypes.
func (t *Topic[T]) HandleBatch(b *Bus, name string, fn func(ctx context.Context, ms []Message[T]) error, opts ...HandleOption) error {
	switch {
	case b == nil:
		return fmt.Errorf("millrace: HandleBatch(%q): the Bus is nil", name)
	case t == nil:
		return fmt.Errorf("millrace: HandleBatch(%q): the Topic is nil", name)
	case fn == nil:
		return b.HandleBatch(t.name, name, nil, opts...)
	}
	unknown, err := b.unknownTypesCounter()
	if err != nil {
		return err
	}
	// With AckUnknown the chain acks the other types before a batch forms.
	spec := handlerSpec{topic: t.name, name: name, batch: func(ctx context.Context, evs []Event, arrivals []arrival) error {
		failures := BatchFailures{}
		ms := make([]Message[T], 0, len(evs))
		for i, ev := range evs {
			if ev.Type != t.typ.name {
				unknown.WithLabelValues(name, typeLabel(ev.Type)).Inc()
				failures[ev.ID] = Permanent(middleware.Invalid("metadata."+EventTypeKey, "event type %q, but batch handler %s takes %q only "+
					"(and bus.WithUnknownTypes(bus.PoisonUnknown) poisons the others); deploy a handler for it and replay the event",
					ev.Type, name, t.typ.name))
				continue
			}
			v, err := decodeEvent[T](t.typ, ev)
			if err != nil {
				failures[ev.ID] = Permanent(err)
				continue
			}
			ms = append(ms, Message[T]{Value: v, Event: ev, Trace: arrivals[i].remote, Attempt: arrivals[i].attempt})
		}
		if len(ms) == 0 {
			return batchResult(failures, nil, nil)
		}
		ids := make([]string, len(ms))
		for i, m := range ms {
			ids[i] = m.ID
		}
		return batchResult(failures, ids, fn(ctx, ms))
	}}
	takes := b.takeTypes(name, t.name, unknown, func(eventType string) bool { return eventType == t.typ.name }, opts)
	spec, errs := newHandlerSpec(spec, append(opts, takes))
	return b.register(spec, errs, "HandleBatch")
}

// batchResult is a batch handler's result: failures, found before the
// handler was called, with err, what it returned for the events ids.
func batchResult(failures BatchFailures, ids []string, err error) error {
	var theirs BatchFailures
	switch {
	case err == nil:
	case errors.As(err, &theirs):
		failures = maps.Clone(failures)
		maps.Copy(failures, theirs)
	case len(failures) == 0:
		return err // the whole batch failed
	default:
		// The whole batch handed to the handler failed, and the events
		// kept from it failed for their own reasons.
		failures = maps.Clone(failures)
		for _, id := range ids {
			failures[id] = err
		}
	}
	if len(failures) == 0 {
		return nil
	}
	return failures
}

// adaptBatch is adapt for a batch handler: it decodes the envelopes (an
// invalid one fails its message alone, permanently), and runs the handler
// in one consumer span linked to the spans that published the events.
func (b *Bus) adaptBatch(h handlerSpec) middleware.BatchHandlerFunc {
	return func(ctx context.Context, msgs []*message.Message) error {
		failures := BatchFailures{}
		evs := make([]Event, 0, len(msgs))
		arrivals := make([]arrival, 0, len(msgs))
		links := make([]trace.Link, 0, len(msgs))
		for _, msg := range msgs {
			ev, err := EventFromMessage(msg)
			if err != nil {
				failures[middleware.EventID(msg)] = Permanent(fmt.Errorf("invalid event envelope: %w", err))
				continue
			}
			remote := trace.SpanContextFromContext(forwarder.Propagator(b.propagator).Extract(ctx, propagation.MapCarrier(msg.Metadata)))
			evs = append(evs, ev)
			arrivals = append(arrivals, arrival{remote: remote, attempt: middleware.Attempt(msg.Context())})
			if remote.IsValid() {
				links = append(links, trace.Link{SpanContext: remote, Attributes: []attribute.KeyValue{attribute.String("messaging.message.id", ev.ID)}})
			}
		}
		if len(evs) == 0 {
			return batchResult(failures, nil, nil)
		}
		ctx, span := b.tracer.Start(ctx, h.topic+" process", trace.WithSpanKind(trace.SpanKindConsumer), trace.WithLinks(links...),
			trace.WithAttributes(
				attribute.String("messaging.operation.type", "process"),
				attribute.String("messaging.destination.name", h.topic),
				attribute.String("messaging.consumer.group.name", h.group),
				attribute.Int("messaging.batch.message_count", len(evs)),
				attribute.String("millrace.handler", h.name),
			))
		defer span.End()
		ids := make([]string, len(evs))
		for i, ev := range evs {
			ids[i] = ev.ID
		}
		err := batchResult(failures, ids, callBatchHandler(h.batch, ctx, evs, arrivals))
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		return err
	}
}

// arrival is how one event of a batch arrived: the span context that
// published it and the attempt's number.
type arrival struct {
	remote  trace.SpanContext
	attempt int
}

// callBatchHandler calls fn; Tx panicking in it makes a permanent error.
func callBatchHandler(fn func(context.Context, []Event, []arrival) error, ctx context.Context, evs []Event, arrivals []arrival) (err error) {
	defer noTxPanic(&err)
	return fn(ctx, evs, arrivals)
}
