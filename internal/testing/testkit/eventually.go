package testkit

import (
	"testing"
	"time"
)

// pollInterval is how often Eventually checks its condition.
const pollInterval = 20 * time.Millisecond

// Eventually calls cond on the test's goroutine (so cond may use require)
// until it returns true, and fails the test when timeout passes first. The
// timeout only catches what never happens; it is no speed threshold.
// testify's require.Eventually runs cond on another goroutine, where
// require's FailNow must not be called; hence this helper.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting until %s", timeout, what)
		}
		time.Sleep(pollInterval)
	}
}
