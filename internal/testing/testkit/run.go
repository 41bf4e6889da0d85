package testkit

import (
	"context"
	"testing"
	"time"
)

// Running is a Run-like function started by Start on its own goroutine.
type Running struct {
	cancel context.CancelFunc
	done   chan error
}

// Start calls run with a context that Stop (or the end of the test)
// cancels, on its own goroutine.
func Start(t testing.TB, run func(context.Context) error) *Running {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	r := &Running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- run(ctx) }()
	return r
}

// Stop cancels the context and returns what run returned; it fails the
// test when run has not returned within timeout.
func (r *Running) Stop(t testing.TB, timeout time.Duration) error {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		return err
	case <-time.After(timeout):
		t.Fatalf("Run did not return within %s after its context was cancelled", timeout)
		return nil
	}
}
