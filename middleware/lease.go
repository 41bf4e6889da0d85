package middleware

import (
	"context"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Worker is a message's hold on one of the workers of the runtime that
// released it to the chain (package consumer's Dispatcher). A message that waits after a
// failed attempt (the retry stage's backoff in process, the breaker while
// it is open) gives its worker back meanwhile (Pause) and takes one again
// before its next attempt (Resume), so that the messages behind it are not
// held back by one that keeps failing or hanging.
type Worker interface {
	// Pause gives the worker to the next message.
	Pause()
	// Resume returns once the message holds a worker again, or with ctx's
	// cause when ctx ended first.
	Resume(ctx context.Context) error
}

// Lease is what the runtime that released a message to the chain tells the
// chain about it. The zero Lease is a message no runtime released (a chain
// driven directly): it has no worker to give back while it waits.
type Lease struct {
	// Worker is the message's worker; nil for none.
	Worker Worker
	// Delivery is the message's delivery number (1 for the first
	// delivery) when its broker schedules its redeliveries, which the
	// retry stage then hands the waits to (see RetryAuto); 0 otherwise.
	Delivery int
}

// Feed is how a runtime feeds a chain its messages (see Chain.Feed).
type Feed struct {
	// Lease returns the Lease of a message the runtime released; the zero
	// Lease for one it did not. The router hands the handler the
	// *message.Message it was given, so Lease can look the message up by
	// its pointer. Nil means every message gets the zero Lease.
	Lease func(msg *message.Message) Lease
	// OneAtATime says the handler is given one message at a time (one
	// subscription of a stock subscriber): group commit is turned off, as
	// a batch would only wait for messages that cannot come.
	OneAtATime bool
}

// Feed tells the chain how the runtime that releases its messages to
// Watermill's router feeds them (the Dispatcher calls it once, before it
// releases any; see package consumer).
func (c *Chain) Feed(f Feed) {
	if f.OneAtATime && c.batcher != nil {
		c.batcher.limit.Store(1)
	}
	if f.Lease != nil {
		c.leases.Store(&f.Lease)
	}
}

// leaseOf is the Lease of msg from the runtime feeding the chain.
func (c *Chain) leaseOf(msg *message.Message) Lease {
	if f := c.leases.Load(); f != nil {
		return (*f)(msg)
	}
	return Lease{}
}

// leaseSource holds the Lease function of the chain's Feed.
type leaseSource = atomic.Pointer[func(msg *message.Message) Lease]

// offWorker runs wait, which may block, with the message's worker w given
// to the next message meanwhile, and takes a worker again before it
// returns. It returns wait's error, or ctx's when it ended while waiting
// for a worker. A nil w (no runtime released the message) just waits.
func offWorker(ctx context.Context, w Worker, wait func() error) error {
	if w == nil {
		return wait()
	}
	w.Pause()
	if err := wait(); err != nil {
		return err
	}
	return w.Resume(ctx)
}
