package testkit

import (
	"strings"
	"testing"
	"time"
)

// fatalRecorder is a testing.TB whose Fatalf records instead of stopping.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}
func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = format
	_ = args
}

func TestEventually(t *testing.T) {
	t.Parallel()
	calls := 0
	Eventually(t, time.Minute, "the third call", func() bool { calls++; return calls == 3 })
	if calls != 3 {
		t.Fatalf("cond called %d times, want 3", calls)
	}

	rec := &fatalRecorder{TB: t}
	Eventually(rec, 0, "never", func() bool { return rec.msg != "" })
	if !strings.HasPrefix(rec.msg, "timed out after") {
		t.Fatalf("a condition that never holds fails the test; got %q", rec.msg)
	}
}
