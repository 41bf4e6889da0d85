package bus

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/middleware"
)

// Message is an event as a typed handler receives it: the decoded value and
// its envelope.
type Message[T any] struct {
	// Value is the event, at the version its Topic declares: decoded from
	// the payload, through the upcasters when it was published with an
	// older version.
	Value T
	// Event is the envelope as it arrived: ID, Type, aggregate, its
	// AggregateVersion, SchemaVersion as published (before upcasting),
	// OccurredAt, CorrelationID, CausationID, ContentType, Metadata, and
	// the raw Payload.
	Event
	// Trace is the span context of the span that published the event (from
	// traceparent); the handler's ctx continues that trace in a span of its
	// own. Invalid when the event carried none.
	Trace trace.SpanContext
	// Attempt is this attempt's number: 1 at the first, 2 at the first
	// retry, and so on (see middleware.Attempt, which a HandlerFunc asks
	// for the same number). A handler that behaves differently on a late
	// attempt reads it here rather than counting deliveries itself.
	Attempt int
}

// A Route sends the events of one Topic's type to one function; On makes
// one, HandleTypes registers them.
type Route struct {
	topic string
	typ   *eventType
	err   error
	call  func(ctx context.Context, ev Event) error
}

// On routes the events of t's type to fn. fn gets each event decoded into
// a T; a payload that does not decode, a content type of another codec, or
// a schema version newer than t's (or older with no upcaster) is a
// permanent failure, and the message is poisoned with a reason naming the
// field or the versions, without calling fn.
func On[T any](t *Topic[T], fn func(ctx context.Context, m Message[T]) error) Route {
	switch {
	case t == nil:
		return Route{err: fmt.Errorf("route for %v: the topic is nil", reflect.TypeFor[T]())}
	case fn == nil:
		return Route{topic: t.name, typ: t.typ, err: fmt.Errorf("route for event type %q: handler func is nil", t.typ.name)}
	}
	return Route{topic: t.name, typ: t.typ, call: func(ctx context.Context, ev Event) error {
		v, err := decodeEvent[T](t.typ, ev)
		if err != nil {
			return Permanent(err)
		}
		remote, _ := ctx.Value(remoteSpanKey{}).(trace.SpanContext)
		return fn(ctx, Message[T]{Value: v, Event: ev, Trace: remote, Attempt: middleware.Attempt(ctx)})
	}}
}

// Handle registers fn to consume the topic under handler name name, like
// Bus.Handle: HandleTypes with one route.
func (t *Topic[T]) Handle(b *Bus, name string, fn func(ctx context.Context, m Message[T]) error, opts ...HandleOption) error {
	if b == nil {
		return fmt.Errorf("millrace: Handle(%q): the Bus is nil", name)
	}
	return b.HandleTypes(name, []Route{On(t, fn)}, opts...)
}

// UnknownTypes is what a typed handler does with an event whose event-type
// none of its routes names: on a topic that carries several types, every
// event of the types another handler consumes. Either way
// millrace_consumer_unknown_types_total counts it, by handler and event
// type.
type UnknownTypes int

const (
	// AckUnknown acks the event without an attempt (the default): no inbox
	// row, no handler call, no transaction. It is counted as
	// millrace_consumer_messages_total{outcome="other_type"} and logged at
	// debug level. A handler takes the types it has routes for, as a saga
	// does.
	AckUnknown UnknownTypes = iota
	// PoisonUnknown poisons the event: it waits in the poison table for a
	// deploy that handles its type and a replay. For a handler that owns
	// its topic, where an event of another type is a mistake.
	PoisonUnknown
)

// WithUnknownTypes sets what a typed handler (HandleTypes, Topic.Handle,
// Topic.HandleBatch, a saga) does with event types it has no route for.
// Defaults to AckUnknown. Handlers registered with Bus.Handle see every
// event and ignore it.
func WithUnknownTypes(rule UnknownTypes) HandleOption {
	return func(s *handlerSpec) { s.unknown = rule }
}

// HandleTypes registers one handler, name, for the routes: one consumer
// group that receives every event of their topic and calls the route whose
// type the event's event-type names. The routes must be on one topic and
// name distinct types. An event of no route's type follows
// WithUnknownTypes. Everything else is as Bus.Handle: the handler's config
// under consumer.handlers.<name>, its inbox transaction (Tx), its
// options. Register every handler before Run.
func (b *Bus) HandleTypes(name string, routes []Route, opts ...HandleOption) error {
	topic, dispatch, takes, err := b.typedHandler(name, routes, opts)
	if err != nil {
		return err
	}
	return b.Handle(topic, name, dispatch, append(opts, takes)...)
}

// ConsumerChainTypes is ConsumerChain for a typed handler: the routes
// wrapped exactly as Run wraps a handler registered with
// HandleTypes(name, routes, opts...), for code that drives deliveries
// itself.
func (b *Bus) ConsumerChainTypes(ctx context.Context, name string, routes []Route, poison message.Publisher, opts ...HandleOption) (message.NoPublishHandlerFunc, error) {
	topic, dispatch, takes, err := b.typedHandler(name, routes, opts)
	if err != nil {
		return nil, err
	}
	return b.ConsumerChain(ctx, topic, name, dispatch, poison, append(opts, takes)...)
}

// typedHandler checks routes and returns their topic, the HandlerFunc that
// dispatches its events to them, and the option that makes the chain ack
// the events of other types (AckUnknown; takeTypes).
func (b *Bus) typedHandler(name string, routes []Route, opts []HandleOption) (string, HandlerFunc, HandleOption, error) {
	var errs []error
	byType := map[string]Route{}
	topic := ""
	for _, r := range routes {
		switch {
		case r.err != nil:
			errs = append(errs, r.err)
			continue
		case topic == "":
			topic = r.topic
		case r.topic != topic:
			errs = append(errs, fmt.Errorf("route for event type %q is on topic %q, the others on %q: one handler consumes one topic", r.typ.name, r.topic, topic))
			continue
		}
		if _, dup := byType[r.typ.name]; dup {
			errs = append(errs, fmt.Errorf("two routes for event type %q: a wire name routes to one function", r.typ.name))
			continue
		}
		byType[r.typ.name] = r
	}
	if len(routes) == 0 {
		errs = append(errs, errors.New("no routes"))
	}
	if len(errs) > 0 {
		return "", nil, nil, fmt.Errorf("millrace: HandleTypes(%q): %w", name, errors.Join(errs...))
	}
	unknown, err := b.unknownTypesCounter()
	if err != nil {
		return "", nil, nil, err
	}
	known := make([]string, 0, len(byType))
	for t := range byType {
		known = append(known, t)
	}
	slices.Sort(known)
	// With AckUnknown the chain acks the other types before dispatch sees them.
	dispatch := func(ctx context.Context, ev Event) error {
		if r, ok := byType[ev.Type]; ok {
			return r.call(ctx, ev)
		}
		unknown.WithLabelValues(name, typeLabel(ev.Type)).Inc()
		return Permanent(middleware.Invalid("metadata."+EventTypeKey, "event type %q has no route in handler %s (it routes %s, "+
			"and bus.WithUnknownTypes(bus.PoisonUnknown) poisons the others); deploy a handler for it and replay the event",
			ev.Type, name, strings.Join(known, ", ")))
	}
	takes := b.takeTypes(name, topic, unknown, func(t string) bool { _, ok := byType[t]; return ok }, opts)
	return topic, dispatch, takes, nil
}

// takeTypes is the HandleOption that, under the rule opts give
// (WithUnknownTypes), makes handler name's chain ack the events whose type
// routes does not take without an attempt (AckUnknown), counting them in
// unknown by type; with PoisonUnknown it changes nothing, and the handler
// poisons them.
func (b *Bus) takeTypes(name, topic string, unknown *prometheus.CounterVec, routes func(eventType string) bool, opts []HandleOption) HandleOption {
	var rule handlerSpec
	for _, o := range opts {
		o(&rule)
	}
	return func(s *handlerSpec) {
		if rule.unknown != AckUnknown {
			return
		}
		s.takes = func(msg *message.Message) bool {
			t := msg.Metadata.Get(EventTypeKey)
			if routes(t) {
				return true
			}
			unknown.WithLabelValues(name, typeLabel(t)).Inc()
			b.logger.Debug("Event of a type this handler has no route for acked", watermill.LogFields{
				"handler": name, "topic": topic, "event_type": t, "event_id": msg.Metadata.Get(EventIDKey)})
			return false
		}
	}
}

// unknownTypesCounter registers millrace_consumer_unknown_types_total on
// the Bus's registry once.
func (b *Bus) unknownTypesCounter() (*prometheus.CounterVec, error) {
	return b.sharedCounter(&b.unknownTypes, prometheus.CounterOpts{
		Name: MetricUnknownTypes,
		Help: "Events a typed handler had no route for, by handler and event type (acked or poisoned, as WithUnknownTypes says).",
	}, "handler", "event_type")
}

// decodeEvent decodes ev's payload into a T at t's version.
func decodeEvent[T any](t *eventType, ev Event) (T, error) {
	var zero T
	if ev.ContentType != "" && mediaType(ev.ContentType) != mediaType(t.codec.ContentType()) {
		return zero, middleware.Invalid("metadata."+ContentTypeKey, "%q, but event type %s is read with codec %s (%s)",
			ev.ContentType, t.name, t.codec.Name(), t.codec.ContentType())
	}
	version := max(ev.SchemaVersion, 1)
	switch {
	case version == t.version:
		v, err := decodeValue[T](t.codec, ev.Payload)
		return v, invalidPayload(err, t, version)
	case version > t.version:
		return zero, middleware.Invalid("metadata."+SchemaVersionKey, "event type %s has schema version %d, newer than version %d, "+
			"the newest this consumer knows: deploy a consumer that knows version %d, then replay the event", t.name, version, t.version, version)
	}
	first, ok := t.upcasters[version]
	if !ok {
		return zero, middleware.Invalid("metadata."+SchemaVersionKey, "event type %s has schema version %d, and this consumer "+
			"(version %d) has no upcaster from it", t.name, version, t.version)
	}
	v, err := first.decode(t.codec, ev.Payload)
	if err != nil {
		return zero, invalidPayload(err, t, version)
	}
	for from := version; from < t.version; from++ {
		if v, err = t.upcasters[from].apply(v); err != nil {
			return zero, &middleware.InvalidError{Field: "payload",
				Problem: fmt.Sprintf("upcasting event type %s from version %d to %d: %v", t.name, from, from+1, err), Err: err}
		}
	}
	return v.(T), nil
}

// invalidPayload makes a codec's error an *InvalidError naming the type
// and version, keeping the codec's field.
func invalidPayload(err error, t *eventType, version int) error {
	if err == nil {
		return nil
	}
	field, problem := "payload", err.Error()
	var ie *middleware.InvalidError
	if errors.As(err, &ie) {
		field, problem = ie.Field, ie.Problem
	}
	return &middleware.InvalidError{Field: field,
		Problem: fmt.Sprintf("event type %s version %d does not decode with codec %s: %s", t.name, version, t.codec.Name(), problem), Err: err}
}

// typeLabel is an event type as a metric label: a header of any length
// and content is no label value, and would make series without bound.
func typeLabel(eventType string) string {
	if len(eventType) > 128 || names.Text(eventType) != nil {
		return "invalid"
	}
	return eventType
}

// remoteSpanKey carries the publishing span's context into a handler.
type remoteSpanKey struct{}
