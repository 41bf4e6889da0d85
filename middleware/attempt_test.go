package middleware

import (
	"runtime"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

// A panic in the inner part of an attempt (the inbox stage's own code),
// which runs in a goroutine of its own, is raised again in the chain's
// goroutine, where the chain's Recoverer turns it into an error (a nack) as
// before, instead of crashing the process.
func TestAttemptRaisesAnInnerPanicInTheChain(t *testing.T) {
	t.Parallel()
	c, _ := retryChain(t, RetryConfig{MaxAttempts: 3})
	m := &inflight{msg: message.NewMessage("evt-1", nil), d: &delivery{eventID: "evt-1"}}
	err := recoverer(c.attempt(func(*inflight) error {
		panic("inbox bug")
	}))(m)
	require.ErrorContains(t, err, "panic in the attempt: inbox bug")
}

// A runtime.Goexit in the inner part (a test simulating a dead process, or
// t.FailNow in a handler) ends the chain's goroutine too, without a result,
// as it did when the attempt ran inline.
func TestAttemptPassesAGoexitOn(t *testing.T) {
	t.Parallel()
	c, _ := retryChain(t, RetryConfig{MaxAttempts: 3})
	m := &inflight{msg: message.NewMessage("evt-1", nil), d: &delivery{eventID: "evt-1"}}
	returned := false
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = c.retry(c.attempt(func(*inflight) error {
			runtime.Goexit()
			return nil
		}))(m)
		returned = true
	}()
	<-done
	require.False(t, returned, "no retry ran; the goroutine ended")
}
