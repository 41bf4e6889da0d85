package adapters

import (
	"errors"

	"github.com/millrace-io/millrace/internal/fault"
)

// The one error vocabulary of millrace: the adapters, the relay and the
// consumer chain classify errors the same way. An error is permanent when
// retrying the same message can never fix it (the relay quarantines the
// row, the chain poisons the message); every other error is retryable.
// bus and middleware re-export Permanent and IsPermanent, so a handler
// written against bus classifies its errors without importing this
// package. The vocabulary itself is internal/fault's, which the consumer
// chain uses without knowing the adapters.

// Errors every adapter returns, matched with errors.Is.
var (
	// ErrClosed: a call on a Broker (or its publisher or subscriber) that was closed.
	ErrClosed = errors.New("broker closed")
	// ErrTopologyConflict: a stream, exchange, queue or topic exists with
	// settings other than the configured ones. The error names the object
	// and each difference. It is permanent: retrying cannot fix it until an
	// operator changes the object or the config (then the relay quarantine
	// can be replayed).
	ErrTopologyConflict = fault.ErrTopologyConflict
	// ErrMessageTooLarge: a message over the broker's size limit; the
	// error text names the limit. It is permanent.
	ErrMessageTooLarge = fault.ErrMessageTooLarge
)

// Permanent marks err as one that retrying the same message cannot fix (a
// payload that does not decode, an unknown schema version, a broken
// invariant, a message the broker refuses). Permanent(nil) is nil.
func Permanent(err error) error { return fault.Permanent(err) }

// IsPermanent reports whether err, or any error it wraps, is permanent: it
// was marked with Permanent, its type says so (a Permanent() bool method
// returning true), or it is ErrMessageTooLarge or ErrTopologyConflict.
func IsPermanent(err error) bool { return fault.IsPermanent(err) }

// IsRetryable reports whether err is an error worth retrying: not nil and
// not permanent.
func IsRetryable(err error) bool { return fault.IsRetryable(err) }
