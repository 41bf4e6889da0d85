package middleware

import (
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/internal/envelope"
)

// Activity is a chain's progress, for a service's health check.
type Activity struct {
	// InChain counts the messages in the chain.
	InChain int
	// Last is when the chain last moved on: a message came in or left, or
	// the handler was called or returned.
	Last time.Time
	// Stuck counts the handler calls running longer than handler_timeout.
	Stuck int
}

// activity follows a chain's messages and handler calls for Activity.
type activity struct {
	mu      sync.Mutex
	inChain int
	last    time.Time
	calls   map[uint64]time.Time // running handler calls by id, with their start
	nextID  uint64
}

func newActivity() *activity {
	return &activity{last: time.Now(), calls: map[uint64]time.Time{}}
}

// Activity reports the chain's progress at now.
func (c *Chain) Activity(now time.Time) Activity {
	a := c.activity
	a.mu.Lock()
	defer a.mu.Unlock()
	stuck := 0
	for _, start := range a.calls {
		if now.Sub(start) > c.cfg.HandlerTimeout {
			stuck++
		}
	}
	return Activity{InChain: a.inChain, Last: a.last, Stuck: stuck}
}

// move records a message entering (+1) or leaving (-1) the chain.
func (a *activity) move(delta int) {
	a.mu.Lock()
	a.inChain += delta
	a.last = time.Now()
	a.mu.Unlock()
}

// call records one call of the handler; the returned func ends it.
func (a *activity) call() (done func()) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.nextID++
	id, now := a.nextID, time.Now()
	a.calls[id], a.last = now, now
	return func() {
		a.mu.Lock()
		delete(a.calls, id)
		a.last = time.Now()
		a.mu.Unlock()
	}
}

// observeLag observes, on Handler.Lag, how long ago msg's event occurred.
func (c *Chain) observeLag(msg *message.Message) {
	if c.spec.Lag == nil {
		return
	}
	if at, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(envelope.OccurredAtKey)); err == nil {
		c.spec.Lag.Observe(time.Since(at).Seconds())
	}
}
