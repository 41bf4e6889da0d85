package middleware

import (
	"context"
	"database/sql/driver"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/fault"
)

// Error classes recorded in a poisoned message's failure envelope
// (PoisonErrorClassKey and the error_class column).
const (
	// ClassPermanent: the message can never be processed as it is (bad
	// payload, unknown schema version, broken invariant). Poisoned at once.
	ClassPermanent = "permanent"
	// ClassTransient: the handler kept failing with a retryable error until
	// retry.max_attempts or retry.max_elapsed ran out.
	ClassTransient = "transient"
)

// IsPermanent reports whether err, or any error it wraps, is permanent:
// marked with bus.Permanent, an *InvalidError, a broker's refusal. It is
// adapters.IsPermanent.
func IsPermanent(err error) bool { return fault.IsPermanent(err) }

// IsRetryable is the one error classification every stage of the chain uses:
// nil and permanent errors are not retryable, every other error is (a
// timeout, a refused connection, a deadlock, a panic in the handler).
func IsRetryable(err error) bool { return fault.IsRetryable(err) }

// InvalidError says which part of a consumed message is invalid. It is
// permanent. Field is a path such as "payload.amount", "metadata" or
// "metadata.event-id".
type InvalidError struct {
	// Field names the part of the message at fault.
	Field string
	// Problem says what is wrong with it.
	Problem string
	// Err is the underlying error, if any (e.g. a *json.UnmarshalTypeError).
	Err error
}

func (e *InvalidError) Error() string { return "invalid " + e.Field + ": " + e.Problem }

// Permanent is true: the message stays invalid however often it is tried.
func (e *InvalidError) Permanent() bool { return true }

// Unwrap returns the underlying error.
func (e *InvalidError) Unwrap() error { return e.Err }

// Invalid returns a permanent *InvalidError for field, e.g.
// Invalid("payload.amount", "must be positive, got %d", n).
func Invalid(field, format string, args ...any) error {
	return &InvalidError{Field: field, Problem: fmt.Sprintf(format, args...)}
}

// DecodeJSON decodes msg's JSON payload into v. A payload that is not JSON,
// or whose fields have the wrong type, is a permanent *InvalidError naming
// the field ("payload.amount: expected number, got string").
func DecodeJSON(msg *message.Message, v any) error {
	err := json.Unmarshal(msg.Payload, v)
	if err == nil {
		return nil
	}
	var bug *json.InvalidUnmarshalError
	var syntax *json.SyntaxError
	var typeErr *json.UnmarshalTypeError
	switch {
	case errors.As(err, &bug):
		// A nil or non-pointer v is a bug in the handler, not in the message:
		// it stays retryable, so the message is poisoned only after retries.
		return fmt.Errorf("decode payload: %w", err)
	case errors.As(err, &syntax):
		return &InvalidError{Field: "payload", Problem: fmt.Sprintf("not valid JSON at byte %d: %v", syntax.Offset, syntax), Err: err}
	case errors.As(err, &typeErr):
		field := "payload"
		if typeErr.Field != "" {
			field += "." + typeErr.Field
		}
		return &InvalidError{Field: field, Problem: fmt.Sprintf("expected %s, got JSON %s", typeErr.Type, typeErr.Value), Err: err}
	default: // an UnmarshalJSON method of v refused the value
		return &InvalidError{Field: "payload", Problem: err.Error(), Err: err}
	}
}

// CheckSchemaVersion returns a permanent *InvalidError naming
// metadata.schema-version when msg's schema version is not one of supported.
// A message without a schema version is version 1.
func CheckSchemaVersion(msg *message.Message, supported ...int) error {
	raw := msg.Metadata.Get(envelope.SchemaVersionKey)
	version := 1
	if raw != "" {
		v, err := strconv.Atoi(raw)
		if err != nil {
			return &InvalidError{Field: "metadata." + envelope.SchemaVersionKey, Problem: fmt.Sprintf("not an integer: %q", raw), Err: err}
		}
		version = v
	}
	if !slices.Contains(supported, version) {
		return Invalid("metadata."+envelope.SchemaVersionKey, "unknown schema version %d (this handler supports %v)", version, supported)
	}
	return nil
}

// errExhausted wraps the last error of a message whose retries ran out.
var errExhausted = errors.New("retries exhausted")

// exhaustedError is returned by the retry stage when a message is to be
// poisoned for a transient error.
type exhaustedError struct {
	attempts int
	err      error
}

func (e *exhaustedError) Error() string {
	return fmt.Sprintf("%d attempts failed, last: %v", e.attempts, e.err)
}

func (e *exhaustedError) Unwrap() []error { return []error{errExhausted, e.err} }

// shutdownError is returned when the consumer stops (the message's context
// is cancelled) while a message waits for a retry or for the breaker. The
// message is nacked and redelivered; it is never poisoned.
type shutdownError struct{ cause error }

func (e *shutdownError) Error() string {
	return "consumer stopping, message returned for redelivery: " + e.cause.Error()
}

func (e *shutdownError) Unwrap() error { return e.cause }

// redeliverError is returned by the retry stage when a failed attempt is to
// be retried by the broker: the message is nacked, and the broker delivers
// it again after the wait of its delivery number. It is never poisoned.
type redeliverError struct {
	delivery int
	err      error
}

func (e *redeliverError) Error() string {
	return fmt.Sprintf("attempt %d failed, the broker delivers the message again after its backoff: %v", e.delivery, e.err)
}

func (e *redeliverError) Unwrap() error { return e.err }

// outageError marks a failure the breaker attributes to a dependency rather
// than to the message: it does not use up the message's retries.
type outageError struct{ err error }

func (e *outageError) Error() string {
	return "dependency outage (circuit breaker open): " + e.err.Error()
}
func (e *outageError) Unwrap() error { return e.err }

// abandonedError is the attempt stage's verdict on an attempt that did not
// return within handler_timeout: the handler ignored its context (a stuck
// driver call, a sleep). The chain stops waiting for it, so the worker is
// freed and a stop stays bounded; its transaction is rolled back and can no
// longer commit; its goroutine is left to finish. It is retryable and always
// counts as a failed attempt of its message (never as an outage, see the
// breaker stage): each abandoned attempt may leave a goroutine behind, and
// a message held for an outage would start a new one at every trial.
type abandonedError struct{ timeout time.Duration }

func (e *abandonedError) Error() string {
	return fmt.Sprintf("attempt abandoned after handler_timeout (%s): the handler did not return in time and ignores its context; "+
		"it is left to finish in the background and its transaction is rolled back", e.timeout)
}

// Unwrap lets errors.Is(err, context.DeadlineExceeded) recognise the timeout.
func (e *abandonedError) Unwrap() error { return context.DeadlineExceeded }

// timedOutError is the attempt stage's verdict on a retryable failure that
// came back once handler_timeout had passed (a handler that honoured its
// context, or a batched message whose batch ran out of time before its
// turn): like an abandoned attempt, a failed attempt of its message and
// never an outage.
type timedOutError struct{ err error }

func (e *timedOutError) Error() string { return "attempt ran out of handler_timeout: " + e.err.Error() }
func (e *timedOutError) Unwrap() error { return e.err }

// timedOut reports whether err is an attempt that handler_timeout ended,
// abandoned or not.
func timedOut(err error) bool {
	return errors.As(err, new(*abandonedError)) || errors.As(err, new(*timedOutError))
}

// unavailableError marks a failure to reach the database in the inbox
// transaction: the message was never judged, so the failure does not use up
// its retries. The retry stage waits its backoff and tries again, for as
// long as the database stays away.
type unavailableError struct{ err error }

func (e *unavailableError) Error() string { return "database unreachable: " + e.err.Error() }
func (e *unavailableError) Unwrap() error { return e.err }

// unreachable reports whether err says the database could not be reached
// (no connection, a connection that broke, a server shutting down or
// starting), as opposed to the server answering with an error.
func unreachable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// Class 08: connection exception; 57P01-03: admin shutdown, crash
		// shutdown, cannot connect now.
		return strings.HasPrefix(pgErr.Code, "08") || slices.Contains([]string{"57P01", "57P02", "57P03"}, pgErr.Code)
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return errors.As(err, &connectErr) || errors.As(err, &netErr) || pgconn.SafeToRetry(err) ||
		errors.Is(err, driver.ErrBadConn) || errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// shouldPoison is the poison queue's filter: permanent failures and messages
// whose retries ran out. Never a shutdown, an open breaker or an outage.
func shouldPoison(err error) bool {
	var sd *shutdownError
	if errors.As(err, &sd) {
		return false
	}
	return IsPermanent(err) || errors.Is(err, errExhausted)
}

// classOf returns the failure envelope's error class for a poisoned error.
func classOf(err error) string {
	if IsPermanent(err) {
		return ClassPermanent
	}
	return ClassTransient
}
