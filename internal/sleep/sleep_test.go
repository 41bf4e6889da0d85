package sleep_test

import (
	"context"
	"testing"
	"time"

	"github.com/millrace-io/millrace/internal/sleep"
)

func TestForWaitsUnlessTheContextEnds(t *testing.T) {
	t.Parallel()
	if !sleep.For(context.Background(), time.Millisecond) {
		t.Error("For returned false without the context ending")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if sleep.For(ctx, time.Hour) {
		t.Error("For waited out an hour on an ended context")
	}
}
