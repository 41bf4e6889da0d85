package bus

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"

	"github.com/millrace-io/millrace/internal/names"
)

// Named is implemented by event types that carry their wire name: the
// event-type every event of the type is published with and routed by. Keep
// it stable: it is part of the contract with every consumer, and renaming
// the Go type must not change it. A type that cannot have methods (a
// protobuf message of another package) gets its name from TypeName.
type Named interface {
	EventType() string
}

// Aggregated is implemented by event types that name the entity they
// change: a typed Publish takes the aggregate-type and aggregate-id (the
// partition and ordering key) from it.
type Aggregated interface {
	Aggregate() (aggregateType, aggregateID string)
}

// Topic is a topic declared with the Go type of its events, T: typed
// Publish accepts only T, and a handler registered with Handle or On gets
// each event decoded into a T. Declare it once, where the event type lives,
// with NewTopic (or Must(NewTopic(...)) for a package-level variable):
//
//	var OrderPlaced = bus.Must(bus.NewTopic[orders.Placed]("orders.events", bus.Version(2),
//		bus.Upcast(1, orders.PlacedFromV1)))
//
// Several event types on one topic are several Topics with the same name;
// one handler receives them all with HandleTypes. A Topic holds no
// connection: it publishes through the Bus it is given.
type Topic[T any] struct {
	name string
	typ  *eventType
}

// eventType is what a Topic knows about its Go type, apart from T.
type eventType struct {
	name    string // the wire name
	version int
	codec   Codec
	// upcasters by the version they read.
	upcasters map[int]upcaster
	goType    reflect.Type
}

// TopicOption changes how NewTopic declares a topic's event type.
type TopicOption func(*topicOptions)

type topicOptions struct {
	typeName  string
	version   int
	codec     string
	upcasters []upcaster
}

// TypeName sets the event type's wire name, for a type without an
// EventType method. Giving both with different names is an error.
func TypeName(name string) TopicOption {
	return func(o *topicOptions) { o.typeName = name }
}

// Version sets the event type's schema version, written in schema-version:
// at least 1. A consumer declared with version N reads older versions
// through its upcasters and poisons newer ones. Defaults to 1.
func Version(n int) TopicOption {
	return func(o *topicOptions) { o.version = n }
}

// WithCodec names the registered codec (RegisterCodec) that encodes the
// event type: CodecJSON, CodecProtobuf or one of the service's own.
// Defaults to CodecJSON.
func WithCodec(name string) TopicOption {
	return func(o *topicOptions) { o.codec = name }
}

// Upcast registers fn to turn an event published with schema version
// fromVersion, decoded as From, into the next version's type To. A topic of
// version N needs one upcaster for each older version it reads, chained
// fromVersion -> N: Upcast(1, v1ToV2) and Upcast(2, v2ToV3) for a Topic of
// version 3 whose type is the result of v2ToV3. An error of fn is
// permanent: the event is poisoned with it.
func Upcast[From, To any](fromVersion int, fn func(From) (To, error)) TopicOption {
	return func(o *topicOptions) {
		o.upcasters = append(o.upcasters, upcaster{
			from:    fromVersion,
			in:      reflect.TypeFor[From](),
			out:     reflect.TypeFor[To](),
			missing: fn == nil,
			decode: func(c Codec, data []byte) (any, error) {
				return decodeValue[From](c, data)
			},
			apply: func(v any) (any, error) { return fn(v.(From)) },
			check: func(c Codec) error { return checkCodec[From](c) },
		})
	}
}

// upcaster is one step of a version chain.
type upcaster struct {
	from    int
	in, out reflect.Type
	missing bool // fn was nil
	decode  func(c Codec, data []byte) (any, error)
	apply   func(v any) (any, error)
	check   func(c Codec) error
}

// NewTopic declares topic name with event type T. It checks everything it
// can before any event is published or handled: the topic name, against
// the rules of every broker kind (a Topic is shared by services whatever
// their broker.kind: "shop.orders." is refused for NATS, whose subjects
// have no empty token, even in a service on Kafka), T's wire name (its
// EventType method or TypeName), the version, that the codec is registered
// and can encode T, and that the upcasters chain every older version to T.
// The error names what is wrong and, for the topic, the broker kind and
// its rule.
func NewTopic[T any](name string, opts ...TopicOption) (*Topic[T], error) {
	o := topicOptions{version: 1, codec: CodecJSON}
	for _, opt := range opts {
		opt(&o)
	}
	goType := reflect.TypeFor[T]()
	fail := func(err error) (*Topic[T], error) {
		return nil, fmt.Errorf("millrace: NewTopic[%v](%q): %w", goType, name, err)
	}
	var errs []error
	if err := names.Topic(name); err != nil {
		errs = append(errs, fmt.Errorf("topic: %w", err))
	} else if err := checkTopicOnEveryBroker(name); err != nil {
		errs = append(errs, err)
	}
	typeName, err := wireName[T](o.typeName)
	if err != nil {
		errs = append(errs, err)
	}
	if o.version < 1 {
		errs = append(errs, fmt.Errorf("version must be at least 1; got %d", o.version))
	}
	codec, err := lookupCodec(o.codec)
	if err != nil {
		errs = append(errs, err)
	} else if err := checkCodec[T](codec); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return fail(errors.Join(errs...))
	}
	et := &eventType{name: typeName, version: o.version, codec: codec, goType: goType, upcasters: map[int]upcaster{}}
	if err := et.chain(o.upcasters); err != nil {
		return fail(err)
	}
	return &Topic[T]{name: name, typ: et}, nil
}

// Must returns t, and panics when err is not nil: for topics declared as
// package-level variables, like regexp.MustCompile.
func Must[T any](t *Topic[T], err error) *Topic[T] {
	if err != nil {
		panic(err)
	}
	return t
}

// wireName is T's EventType() or option, checked.
func wireName[T any](option string) (string, error) {
	var method string
	v := newTarget[T]()
	if n, ok := any(v).(Named); ok {
		method = n.EventType()
	} else if n, ok := any(&v).(Named); ok {
		method = n.EventType()
	}
	name := option
	switch {
	case option != "" && method != "" && option != method:
		return "", fmt.Errorf("two wire names: TypeName(%q) and EventType() %q; keep one", option, method)
	case option == "" && method == "":
		return "", fmt.Errorf("no wire name: give %v an EventType() string method or pass bus.TypeName (the Go type's name is not used, so that renaming it changes nothing on the wire)", reflect.TypeFor[T]())
	case name == "":
		name = method
	}
	if err := names.Text(name); err != nil {
		return "", fmt.Errorf("wire name %q: %w", name, err)
	}
	return name, nil
}

// chain checks that ups take every version before t.version to t's type, one
// step at a time, and records them.
func (t *eventType) chain(ups []upcaster) error {
	var errs []error
	for _, u := range ups {
		switch {
		case u.missing:
			errs = append(errs, fmt.Errorf("upcaster from version %d is nil", u.from))
		case u.from < 1 || u.from >= t.version:
			errs = append(errs, fmt.Errorf("upcaster from version %d: must read a version from 1 to %d (the topic's version is %d)", u.from, t.version-1, t.version))
		case t.upcasters[u.from].apply != nil:
			errs = append(errs, fmt.Errorf("two upcasters from version %d", u.from))
		default:
			if err := u.check(t.codec); err != nil {
				errs = append(errs, fmt.Errorf("upcaster from version %d: %w", u.from, err))
			}
			t.upcasters[u.from] = u
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	froms := make([]int, 0, len(t.upcasters))
	for v := range t.upcasters {
		froms = append(froms, v)
	}
	slices.Sort(froms)
	for i, v := range froms {
		u := t.upcasters[v]
		want := t.goType
		if next, ok := t.upcasters[v+1]; ok {
			want = next.in
		} else if v+1 != t.version {
			errs = append(errs, fmt.Errorf("no upcaster from version %d: the one from version %d cannot reach version %d", v+1, froms[i], t.version))
			continue
		}
		if u.out != want {
			errs = append(errs, fmt.Errorf("upcaster from version %d returns %v, but version %d is read as %v", v, u.out, v+1, want))
		}
	}
	return errors.Join(errs...)
}

// Name is the topic's name.
func (t *Topic[T]) Name() string { return t.name }

// TypeName is the wire name of T, written in event-type.
func (t *Topic[T]) TypeName() string { return t.typ.name }

// Version is T's schema version, written in schema-version.
func (t *Topic[T]) Version() int { return t.typ.version }

// Publish writes values into the outbox within tx, as Bus.Publish does with
// events: T's wire name as the type, its version, the codec's payload and
// content type, the aggregate from T's Aggregate method. Every value is
// checked (and encoded) before anything is written; on any error nothing
// is written. The error of a refused value is an *EventError with its Index.
func (t *Topic[T]) Publish(ctx context.Context, b *Bus, tx Execer, values ...T) error {
	if b == nil {
		return errNilBus
	}
	events, err := t.events(values)
	if err != nil {
		return err
	}
	return b.Publish(ctx, tx, t.name, events...)
}

// errNilBus is a typed Publish given no Bus.
var errNilBus = errors.New("millrace: a typed Publish needs the Bus to publish through; it is nil")

// Event returns the event Publish would write for v, for a caller that sets
// more of the envelope (ID, AggregateVersion, CorrelationID, Metadata, a
// different aggregate) before it passes the event to Bus.Publish with
// t.Name(). Leave Type, SchemaVersion, ContentType and Payload as they are:
// the topic's consumers decode by them.
func (t *Topic[T]) Event(v T) (Event, error) {
	if isNil(v) {
		return Event{}, &EventError{Field: "Value", Type: t.typ.name, Kind: ErrMissingField, Detail: fmt.Sprintf("a nil %v", t.typ.goType)}
	}
	payload, err := t.typ.codec.Marshal(target(&v))
	if err != nil {
		return Event{}, &EventError{Field: "Value", Type: t.typ.name, Kind: ErrInvalidPayload,
			Detail: fmt.Sprintf("codec %s: %v", t.typ.codec.Name(), err), Err: err}
	}
	ev := Event{Type: t.typ.name, SchemaVersion: t.typ.version, ContentType: t.typ.codec.ContentType(), Payload: payload}
	if a, ok := aggregated(&v); ok {
		ev.AggregateType, ev.AggregateID = a.Aggregate()
	}
	return ev, nil
}

// events encodes values, each checked.
func (t *Topic[T]) events(values []T) ([]Event, error) {
	events := make([]Event, len(values))
	for i, v := range values {
		ev, err := t.Event(v)
		if err == nil && (ev.AggregateType == "" || ev.AggregateID == "") {
			if _, ok := aggregated(&v); !ok {
				err = &EventError{Field: "AggregateID", Type: t.typ.name, Kind: ErrMissingField,
					Detail: fmt.Sprintf("%v has no Aggregate() (aggregateType, aggregateID string) method: add one, "+
						"or build the event with Topic.Event, set AggregateType and AggregateID, and publish it with Bus.Publish", t.typ.goType)}
			}
		}
		if err != nil {
			var ee *EventError
			if errors.As(err, &ee) {
				ee.Index = i
			}
			return nil, err
		}
		events[i] = ev
	}
	return events, nil
}

// aggregated is v's Aggregated, with a value or pointer receiver.
func aggregated[T any](v *T) (Aggregated, bool) {
	if a, ok := any(*v).(Aggregated); ok && !isNil(*v) {
		return a, true
	}
	a, ok := any(v).(Aggregated)
	return a, ok
}

// target is what a codec encodes or decodes for v: v itself when T is a
// pointer type (a protobuf message), a pointer to it otherwise.
func target[T any](v *T) any {
	if reflect.TypeFor[T]().Kind() == reflect.Pointer {
		return *v
	}
	return v
}

// newTarget is a zero T that a codec can decode into: a new value for a
// pointer type.
func newTarget[T any]() T {
	var v T
	if rt := reflect.TypeFor[T](); rt.Kind() == reflect.Pointer {
		v = reflect.New(rt.Elem()).Interface().(T)
	}
	return v
}

// decodeValue decodes data into a new T.
func decodeValue[T any](c Codec, data []byte) (T, error) {
	v := newTarget[T]()
	err := c.Unmarshal(data, target(&v))
	return v, err
}

// checkCodec makes sure c can encode a T, at declaration instead of at the
// first Publish.
func checkCodec[T any](c Codec) error {
	v := newTarget[T]()
	if _, err := c.Marshal(target(&v)); err != nil {
		return fmt.Errorf("codec %s cannot encode %v: %w", c.Name(), reflect.TypeFor[T](), err)
	}
	return nil
}

// isNil reports a nil pointer, interface, map, slice, func or channel.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan:
		return rv.IsNil()
	}
	return false
}
