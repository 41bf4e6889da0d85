// Package fault is millrace's one error vocabulary: an error is permanent
// when retrying the same message can never fix it (the relay quarantines
// the row, the consumer chain poisons the message); every other error is
// retryable. The adapters, the relay and the consumer chain classify
// errors through it. It is internal so that it has one public door per
// audience: adapters.Permanent for broker adapters, bus.Permanent for
// handlers; middleware.IsPermanent and middleware.IsRetryable are this
// package's.
package fault

import "errors"

var (
	// ErrTopologyConflict is adapters.ErrTopologyConflict: permanent.
	ErrTopologyConflict = errors.New("existing broker topology differs from the configured one")
	// ErrMessageTooLarge is adapters.ErrMessageTooLarge: permanent.
	ErrMessageTooLarge = errors.New("message larger than the broker accepts")
)

// permanent is implemented by errors that say, by their type, whether
// retrying can fix them (*adapters.RefusedError, bus.EventError,
// middleware.InvalidError, and Permanent's own).
type permanent interface{ Permanent() bool }

// permanentError marks an error that retrying cannot fix.
type permanentError struct{ err error }

func (e *permanentError) Error() string   { return e.err.Error() }
func (e *permanentError) Unwrap() error   { return e.err }
func (e *permanentError) Permanent() bool { return true }

// Permanent marks err as one that retrying the same message cannot fix.
// Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err, or any error it wraps, is permanent: it
// was marked with Permanent, its type says so (a Permanent() bool method
// returning true), or it is ErrMessageTooLarge or ErrTopologyConflict.
func IsPermanent(err error) bool {
	var p permanent
	if errors.As(err, &p) && p.Permanent() {
		return true
	}
	return errors.Is(err, ErrMessageTooLarge) || errors.Is(err, ErrTopologyConflict)
}

// IsRetryable reports whether err is an error worth retrying: not nil and
// not permanent.
func IsRetryable(err error) bool { return err != nil && !IsPermanent(err) }
