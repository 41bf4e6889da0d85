// Package sleep is the one context-aware sleep of the relay, the consumer
// chain and the adapters: time.Sleep cannot be interrupted, and the
// standard library has no sleep that ends with a context.
package sleep

import (
	"context"
	"time"
)

// For waits for d and returns true, or returns false as soon as ctx ends.
func For(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
