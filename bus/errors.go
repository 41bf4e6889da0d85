package bus

import (
	"errors"
	"fmt"

	"github.com/millrace-io/millrace/adapters"
)

// Errors Publish returns; test for them with errors.Is. When one is returned,
// nothing was written. A transaction that was already committed or rolled
// back yields an error wrapping database/sql's sql.ErrTxDone.
var (
	// ErrNilTx: Publish was given no transaction.
	ErrNilTx = errors.New("millrace: Publish needs the caller's transaction (a *sql.Tx, or bus.Pgx(tx) for a pgx.Tx); use PublishInOwnTx to publish without a business transaction")
	// ErrInvalidTopic: the destination topic is empty or has characters brokers reject.
	ErrInvalidTopic = errors.New("millrace: invalid topic")
	// ErrMissingField: a required Event field is empty.
	ErrMissingField = errors.New("millrace: missing required event field")
	// ErrInvalidField: an Event field has a value that is not allowed.
	ErrInvalidField = errors.New("millrace: invalid event field")
	// ErrInvalidPayload: the payload does not fit outbox.codec.
	ErrInvalidPayload = errors.New("millrace: invalid payload")
	// ErrPayloadTooLarge: the payload exceeds outbox.max_payload_bytes.
	ErrPayloadTooLarge = errors.New("millrace: payload too large")
	// ErrMetadataTooLarge: the metadata exceeds outbox.max_metadata_bytes.
	ErrMetadataTooLarge = errors.New("millrace: metadata too large")
	// ErrClosed: the Bus, or a broker, was closed. Every registration
	// (Handle and the typed, batch and saga ones) and Run on a closed Bus
	// return it too. It is adapters.ErrClosed, the one sentinel for closed
	// things: errors.Is(err, bus.ErrClosed) matches a closed broker's error
	// as well.
	ErrClosed = adapters.ErrClosed
	// ErrRefusedByBroker: the configured broker (broker.kind) would refuse
	// the event, or not carry it unchanged: a header name it reserves, a
	// message over its size limit. The *EventError's Err is the broker's
	// *adapters.RefusedError.
	ErrRefusedByBroker = errors.New("millrace: the configured broker would refuse or alter the event")
)

// EventError says which event of a Publish call was refused and why.
// errors.Is matches it against the sentinel in Kind.
type EventError struct {
	// Index is the event's position in the Publish call.
	Index int
	// Type is the event's Type, to help find it in logs.
	Type string
	// Field is the Event field at fault, e.g. "Payload" or "Metadata".
	Field string
	// Key is the metadata key at fault when Field is "Metadata", else "".
	Key string
	// Kind is one of the Err* sentinels above.
	Kind error
	// Detail says what was wrong.
	Detail string
	// Err is the underlying error, if any: the broker's
	// *adapters.RefusedError for ErrRefusedByBroker.
	Err error
}

func (e *EventError) Error() string {
	field := e.Field
	if e.Key != "" {
		field += fmt.Sprintf("[%q]", e.Key)
	}
	return fmt.Sprintf("%v: event %d (type %q): %s: %s", e.Kind, e.Index, e.Type, field, e.Detail)
}

// Unwrap returns Kind and Err, so errors.Is(err, ErrPayloadTooLarge) and
// errors.As(err, &refused) work.
func (e *EventError) Unwrap() []error {
	if e.Err == nil {
		return []error{e.Kind}
	}
	return []error{e.Kind, e.Err}
}

// Permanent is true: Publish refuses the same event again. An *EventError
// met by a handler (publishing a follow-up event) poisons the message at once.
func (e *EventError) Permanent() bool { return true }

// Permanent marks err as one that retrying cannot fix; a handler returns it
// for a payload that does not decode, an unknown schema version or a broken
// business invariant, and the message is poisoned at once instead of
// retried. The relay, the consumer chain and the adapters recognise it too
// (it is adapters.Permanent, which the adapters use inside). Permanent(nil)
// is nil.
func Permanent(err error) error { return adapters.Permanent(err) }

// IsPermanent reports whether err, or any error it wraps, is permanent:
// marked with Permanent, an *EventError, a *middleware.InvalidError, a
// broker's *adapters.RefusedError, a message too large or a topology
// conflict.
func IsPermanent(err error) bool { return adapters.IsPermanent(err) }

func fieldErr(field string, kind error, detail string) *EventError {
	return &EventError{Field: field, Kind: kind, Detail: detail}
}

// errBusClosed is what a closed Bus returns: ErrClosed, saying it is the
// Bus that is closed.
var errBusClosed error = busClosedError{}

type busClosedError struct{}

func (busClosedError) Error() string { return "millrace: bus is closed" }
func (busClosedError) Unwrap() error { return ErrClosed }
