package bus

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"mime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"

	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/middleware"
)

// Metadata keys of the event envelope. Every event carries them as message
// metadata, which each broker adapter sends as headers.
const (
	// EventIDKey holds the event id, equal to the Watermill message UUID. It is
	// set once when the event is written and never changes across retries.
	EventIDKey = envelope.EventIDKey
	// EventTypeKey holds the event type, e.g. "OrderCreated".
	EventTypeKey = envelope.EventTypeKey
	// AggregateTypeKey holds the aggregate type, e.g. "order".
	AggregateTypeKey = envelope.AggregateTypeKey
	// AggregateIDKey holds the aggregate id: the partition and ordering key.
	AggregateIDKey = envelope.AggregateIDKey
	// AggregateVersionKey holds the aggregate version as a decimal integer.
	AggregateVersionKey = envelope.AggregateVersionKey
	// SchemaVersionKey holds the payload's schema version as a decimal integer.
	SchemaVersionKey = envelope.SchemaVersionKey
	// OccurredAtKey holds when the event happened, RFC 3339 with nanoseconds, UTC.
	OccurredAtKey = envelope.OccurredAtKey
	// CorrelationIDKey holds the id shared by every event of one business flow.
	CorrelationIDKey = envelope.CorrelationIDKey
	// CausationIDKey holds the id of the event or command that caused this one.
	CausationIDKey = envelope.CausationIDKey
	// TraceparentKey holds the W3C traceparent of the publishing span.
	TraceparentKey = envelope.TraceparentKey
	// TracestateKey holds the W3C tracestate of the publishing span.
	TracestateKey = envelope.TracestateKey
	// BaggageKey holds the W3C baggage of the publishing context.
	BaggageKey = envelope.BaggageKey
	// ContentTypeKey holds the payload's media type: Event.ContentType, or
	// outbox.codec's.
	ContentTypeKey = envelope.ContentTypeKey
)

// Event is one integration event as a service publishes it.
type Event struct {
	// ID is the event id. Leave it empty to get a new UUIDv7; set it to make a
	// retried publish of the same business fact carry the same id.
	ID string
	// Type names the event, e.g. "OrderCreated". Required.
	Type string
	// AggregateType names the kind of entity that changed, e.g. "order". Required.
	AggregateType string
	// AggregateID identifies the entity; it is the partition and ordering key. Required.
	AggregateID string
	// AggregateVersion is the entity's version after this change; 0 means unversioned.
	AggregateVersion int64
	// SchemaVersion is the payload schema's version. Defaults to 1.
	SchemaVersion int
	// OccurredAt is when the change happened. Defaults to the time of Publish.
	OccurredAt time.Time
	// CorrelationID ties together the events of one business flow. Optional.
	CorrelationID string
	// CausationID is the id of the message that caused this event. Optional.
	CausationID string
	// Payload is the event body, checked against ContentType.
	Payload []byte
	// ContentType is the payload's media type, written in content-type.
	// Empty means outbox.codec's: application/json (the payload must be
	// valid JSON) for "json", application/octet-stream for "bytes". A JSON
	// type (application/json, or one ending in +json) must hold valid JSON
	// whatever outbox.codec says; any other type is carried as it is. Typed
	// topics set it from their codec.
	ContentType string
	// Metadata holds extra headers. Keys must not collide with the envelope keys.
	Metadata map[string]string
}

// maxIDLength bounds caller-chosen event ids; the inbox stores them as keys.
const maxIDLength = 128

var reservedKeys = map[string]bool{
	EventIDKey: true, EventTypeKey: true, AggregateTypeKey: true, AggregateIDKey: true,
	AggregateVersionKey: true, SchemaVersionKey: true, OccurredAtKey: true,
	CorrelationIDKey: true, CausationIDKey: true, TraceparentKey: true, TracestateKey: true,
	BaggageKey: true, ContentTypeKey: true,
}

// toMessage checks e and turns it into the Watermill message that goes inside
// the outbox envelope. now is the time of Publish; prop writes ctx's trace
// context and baggage into the metadata; cePrefix, when not empty, is the
// broker's CloudEvents header prefix (outbox.cloudevents).
func (e Event) toMessage(ctx context.Context, cfg OutboxConfig, now time.Time, prop propagation.TextMapPropagator, cePrefix string) (*message.Message, error) {
	if err := e.check(); err != nil {
		return nil, err
	}
	if err := cfg.checkPayloadSize(e.Payload); err != nil {
		return nil, err
	}
	contentType, err := checkPayload(cfg.Codec, e.ContentType, e.Payload)
	if err != nil {
		return nil, err
	}
	meta, err := e.userMetadata(prop, cePrefix)
	if err != nil {
		return nil, err
	}
	id := e.ID
	if id == "" {
		id = uuid.Must(uuid.NewV7()).String()
	}
	occurred := e.OccurredAt
	if occurred.IsZero() {
		occurred = now
	}
	meta[EventIDKey] = id
	meta[EventTypeKey] = e.Type
	meta[AggregateTypeKey] = e.AggregateType
	meta[AggregateIDKey] = e.AggregateID
	meta[AggregateVersionKey] = strconv.FormatInt(e.AggregateVersion, 10)
	meta[SchemaVersionKey] = strconv.Itoa(max(e.SchemaVersion, 1))
	meta[OccurredAtKey] = occurred.UTC().Format(time.RFC3339Nano)
	meta[ContentTypeKey] = contentType
	e.setFlow(ctx, meta)
	if cePrefix != "" {
		meta[cePrefix+"id"] = id
		meta[cePrefix+"type"] = e.Type
		meta[cePrefix+"source"] = cfg.CloudEvents.Source
		meta[cePrefix+"specversion"] = "1.0"
		meta[cePrefix+"time"] = meta[OccurredAtKey]
	}
	prop.Inject(ctx, propagation.MapCarrier(meta))
	if err := cfg.checkMetadataSize(meta); err != nil {
		return nil, err
	}
	msg := message.NewMessage(id, e.Payload)
	msg.Metadata = meta
	return msg, nil
}

// check refuses an event whose required fields are missing or whose fields
// hold what the headers cannot carry, naming the field.
func (e Event) check() error {
	switch {
	case e.Type == "":
		return fieldErr("Type", ErrMissingField, "event type is required")
	case e.AggregateType == "":
		return fieldErr("AggregateType", ErrMissingField, "aggregate type is required")
	case e.AggregateID == "":
		return fieldErr("AggregateID", ErrMissingField, "aggregate id is required")
	}
	for _, f := range []struct{ name, value string }{
		{"ID", e.ID}, {"Type", e.Type}, {"AggregateType", e.AggregateType}, {"AggregateID", e.AggregateID},
		{"CorrelationID", e.CorrelationID}, {"CausationID", e.CausationID},
	} {
		if err := names.Text(f.value); err != nil {
			return fieldErr(f.name, ErrInvalidField, err.Error())
		}
	}
	switch {
	case len(e.ID) > maxIDLength:
		return fieldErr("ID", ErrInvalidField, fmt.Sprintf("event id is %d bytes, the limit is %d", len(e.ID), maxIDLength))
	case e.AggregateVersion < 0:
		return fieldErr("AggregateVersion", ErrInvalidField, fmt.Sprintf("must not be negative, got %d", e.AggregateVersion))
	case e.SchemaVersion < 0:
		return fieldErr("SchemaVersion", ErrInvalidField, fmt.Sprintf("must not be negative, got %d", e.SchemaVersion))
	case !e.OccurredAt.IsZero() && (e.OccurredAt.UTC().Year() < 0 || e.OccurredAt.UTC().Year() > 9999):
		return fieldErr("OccurredAt", ErrInvalidField,
			fmt.Sprintf("year %d is outside 0000-9999, which RFC 3339 (the occurred-at header) can hold", e.OccurredAt.UTC().Year()))
	}
	return nil
}

// userMetadata copies e.Metadata into a new map with room for the headers
// millrace sets, refusing keys that the trace propagator or CloudEvents
// (cePrefix, when not empty) own.
func (e Event) userMetadata(prop propagation.TextMapPropagator, cePrefix string) (message.Metadata, error) {
	meta := make(message.Metadata, len(e.Metadata)+12)
	for k, v := range e.Metadata {
		if err := checkMetadata(k, v); err != nil {
			err.Key = k
			return nil, err
		}
		if slices.Contains(prop.Fields(), k) {
			return nil, &EventError{Field: "Metadata", Key: k, Kind: ErrInvalidField,
				Detail: fmt.Sprintf("key %q is set by the trace propagator", k)}
		}
		if cePrefix != "" && len(k) >= len(cePrefix) && strings.EqualFold(k[:len(cePrefix)], cePrefix) {
			return nil, &EventError{Field: "Metadata", Key: k, Kind: ErrInvalidField,
				Detail: fmt.Sprintf("keys starting with %q hold CloudEvents attributes, which millrace writes (outbox.cloudevents.enabled)", cePrefix)}
		}
		meta[k] = v
	}
	return meta, nil
}

// setFlow writes the correlation and causation headers: an event published
// while a handler handles another continues that event's flow.
func (e Event) setFlow(ctx context.Context, meta message.Metadata) {
	if in, ok := incomingEvent(ctx); ok {
		e.CausationID = cmp.Or(e.CausationID, in.ID)
		e.CorrelationID = cmp.Or(e.CorrelationID, in.CorrelationID, in.ID)
	}
	if e.CorrelationID != "" {
		meta[CorrelationIDKey] = e.CorrelationID
	}
	if e.CausationID != "" {
		meta[CausationIDKey] = e.CausationID
	}
}

// checkPayloadSize refuses a payload over outbox.max_payload_bytes.
func (c OutboxConfig) checkPayloadSize(payload []byte) error {
	if len(payload) > c.MaxPayloadBytes {
		return fieldErr("Payload", ErrPayloadTooLarge,
			fmt.Sprintf("%d bytes, the limit (outbox.max_payload_bytes) is %d", len(payload), c.MaxPayloadBytes))
	}
	return nil
}

// checkMetadataSize refuses metadata, the envelope keys included, over
// outbox.max_metadata_bytes.
func (c OutboxConfig) checkMetadataSize(meta message.Metadata) error {
	size := 0
	for k, v := range meta {
		size += len(k) + len(v)
	}
	if size > c.MaxMetadataBytes {
		return fieldErr("Metadata", ErrMetadataTooLarge,
			fmt.Sprintf("%d bytes with the envelope keys, the limit (outbox.max_metadata_bytes) is %d", size, c.MaxMetadataBytes))
	}
	return nil
}

// checkMetadata checks one metadata entry against what every broker and
// millrace's tables carry; the broker's own Rules check it again.
func checkMetadata(k, v string) *EventError {
	switch {
	case k == "":
		return fieldErr("Metadata", ErrInvalidField, "empty metadata key")
	case reservedKeys[k]:
		return fieldErr("Metadata", ErrInvalidField, fmt.Sprintf("key %q is set by millrace; use the Event field instead", k))
	case reservedKey(k):
		return fieldErr("Metadata", ErrInvalidField, fmt.Sprintf("key %q is reserved: the consumer chain sets it on poisoned and replayed messages", k))
	}
	if err := names.Text(k); err != nil {
		return fieldErr("Metadata", ErrInvalidField, "key: "+err.Error())
	}
	if err := names.Value(v); err != nil {
		return fieldErr("Metadata", ErrInvalidField, "value: "+err.Error())
	}
	return nil
}

// reservedKey reports a key of the consumer chain's failure envelope or
// replay markers.
func reservedKey(k string) bool {
	return k == middleware.ReplayOfKey || k == middleware.ReplayGroupsKey || strings.HasPrefix(k, "poison-") || k == middleware.PoisonedAtKey
}

// checkPayload returns the content type of a payload: contentType, or
// outbox.codec's when it is empty; a JSON type's payload must be JSON.
func checkPayload(codec, contentType string, payload []byte) (string, error) {
	if contentType == "" {
		switch codec {
		case CodecBytes:
			return "application/octet-stream", nil
		default:
			if !json.Valid(payload) {
				return "", fieldErr("Payload", ErrInvalidPayload, fmt.Sprintf("not valid JSON (outbox.codec is %q)", CodecJSON))
			}
			return "application/json", nil
		}
	}
	if err := names.Text(contentType); err != nil {
		return "", fieldErr("ContentType", ErrInvalidField, err.Error())
	}
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return "", fieldErr("ContentType", ErrInvalidField, fmt.Sprintf("not a media type: %v", err))
	}
	if (mt == "application/json" || strings.HasSuffix(mt, "+json")) && !json.Valid(payload) {
		return "", fieldErr("Payload", ErrInvalidPayload, fmt.Sprintf("not valid JSON (ContentType is %q)", contentType))
	}
	return contentType, nil
}

// EventFromMessage reads the envelope fields of a consumed (or unwrapped)
// message. It accepts messages written by plain Watermill too: absent fields
// stay zero and the id falls back to the message UUID. A present but
// malformed field is an error naming the key.
func EventFromMessage(msg *message.Message) (Event, error) {
	e := Event{
		ID:            cmp.Or(msg.Metadata.Get(EventIDKey), msg.UUID),
		Type:          msg.Metadata.Get(EventTypeKey),
		AggregateType: msg.Metadata.Get(AggregateTypeKey),
		AggregateID:   msg.Metadata.Get(AggregateIDKey),
		CorrelationID: msg.Metadata.Get(CorrelationIDKey),
		CausationID:   msg.Metadata.Get(CausationIDKey),
		Payload:       msg.Payload,
		ContentType:   msg.Metadata.Get(ContentTypeKey),
	}
	var err error
	if v := msg.Metadata.Get(AggregateVersionKey); v != "" {
		if e.AggregateVersion, err = strconv.ParseInt(v, 10, 64); err != nil {
			return Event{}, fmt.Errorf("metadata %s: not an integer: %q", AggregateVersionKey, v)
		}
	}
	if v := msg.Metadata.Get(SchemaVersionKey); v != "" {
		if e.SchemaVersion, err = strconv.Atoi(v); err != nil {
			return Event{}, fmt.Errorf("metadata %s: not an integer: %q", SchemaVersionKey, v)
		}
	}
	if v := msg.Metadata.Get(OccurredAtKey); v != "" {
		if e.OccurredAt, err = time.Parse(time.RFC3339Nano, v); err != nil {
			return Event{}, fmt.Errorf("metadata %s: not an RFC 3339 time: %q", OccurredAtKey, v)
		}
	}
	for k, v := range msg.Metadata {
		if !reservedKeys[k] {
			if e.Metadata == nil {
				e.Metadata = map[string]string{}
			}
			e.Metadata[k] = v
		}
	}
	return e, nil
}
