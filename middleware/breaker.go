package middleware

import (
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sony/gobreaker/v2"
)

// breaker is one handler's circuit breaker: sony/gobreaker decides the state;
// this type makes a message wait while the breaker is open instead of failing
// it. Watermill's CircuitBreaker middleware is not used because it fails fast
// while open (the retry stage would use up attempts and poison messages during
// an outage) and is built on gobreaker v1.
//
// While the breaker is open no attempt runs: the message in hand waits, and
// since Watermill's subscribers deliver the next message of a subscription
// only after the current one is acked or nacked, the handler's subscriptions
// pause. After breaker.open_timeout, half_open_requests trial attempts run;
// the others keep waiting until the trials close or reopen the breaker.
type breaker struct {
	cb      *gobreaker.CircuitBreaker[[]*message.Message]
	timeout time.Duration
	gauge   prometheus.Gauge
	logger  watermill.LoggerAdapter
	name    string

	mu       sync.Mutex
	changed  chan struct{} // closed and replaced on every state change
	openedAt time.Time
	// The failure streak since the last success: its first event id, and
	// whether another message failed in it too. Failures of several messages
	// point at a dependency; failures of one message only point at the message.
	streakFirst string
	streakMulti bool

	// probe, when set, decides whether a failure is the dependency's (see
	// ProbeFunc); each call is bounded by probeTimeout. down is set while
	// it fails, probing while a waiter is asking it.
	probe        ProbeFunc
	probeTimeout time.Duration
	down         bool
	probing      bool
}

func newBreaker(name string, cfg BreakerConfig, gauge prometheus.Gauge, logger watermill.LoggerAdapter) *breaker {
	b := &breaker{
		timeout: cfg.OpenTimeout,
		gauge:   gauge,
		logger:  logger,
		name:    name,
		changed: make(chan struct{}),
	}
	threshold := uint32(cfg.ConsecutiveFailures)
	b.cb = gobreaker.NewCircuitBreaker[[]*message.Message](gobreaker.Settings{
		Name:        name,
		MaxRequests: uint32(cfg.HalfOpenRequests),
		Timeout:     cfg.OpenTimeout,
		ReadyToTrip: func(counts gobreaker.Counts) bool {
			return counts.ConsecutiveFailures >= threshold
		},
		// A permanent error means the dependency answered and the message
		// was bad: for the breaker that is a success.
		IsSuccessful:  func(err error) bool { return !IsRetryable(err) },
		OnStateChange: b.onStateChange,
	})
	gauge.Set(BreakerClosed)
	return b
}

// onStateChange runs under gobreaker's lock: it must not call b.cb.
func (b *breaker) onStateChange(_ string, from, to gobreaker.State) {
	b.mu.Lock()
	switch to {
	case gobreaker.StateOpen:
		b.openedAt = time.Now()
	case gobreaker.StateClosed:
		b.streakFirst, b.streakMulti = "", false
	}
	close(b.changed)
	b.changed = make(chan struct{})
	down := b.down
	b.mu.Unlock()

	if !down { // a failing probe holds the breaker open
		b.gauge.Set(gaugeOf(to))
	}
	b.logger.Info("Circuit breaker changed state", watermill.LogFields{"handler": b.name, "from": from.String(), "to": to.String()})
}

// gaugeOf is millrace_consumer_breaker_state's value for state.
func gaugeOf(state gobreaker.State) float64 {
	return map[gobreaker.State]float64{
		gobreaker.StateClosed: BreakerClosed, gobreaker.StateHalfOpen: BreakerHalfOpen, gobreaker.StateOpen: BreakerOpen,
	}[state]
}

// middleware is the breaker stage.
func (b *breaker) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		d := deliveryFrom(ctx)
		rejected := false
		for {
			waited, err := b.admit(ctx, rejected)
			d.held += waited
			if err != nil {
				return nil, &shutdownError{cause: err}
			}
			called := false
			out, err := b.cb.Execute(func() ([]*message.Message, error) {
				called = true
				return h(msg)
			})
			if !called {
				// The state changed between admit and Execute (open again, or
				// the half-open trials are taken): wait for the next change.
				rejected = true
				continue
			}
			// An attempt that handler_timeout ended opens the breaker like
			// any failure (a dependency that hangs every call is then tried
			// once per open_timeout rather than by every worker) but is
			// never taken for an outage: it uses up one of its message's
			// attempts.
			outage := b.record(d.eventID, err) && !timedOut(err)
			if b.probes(ctx, err) { // the probe's verdict replaces the guess
				var took time.Duration
				err, took = b.judge(ctx, err)
				d.held += took
				return out, err
			}
			if outage {
				return out, &outageError{err: err}
			}
			return out, err
		}
	}
}

// admit waits until the breaker may let an attempt through, or ctx ends.
// rejected says the previous Execute was turned away. It returns how long
// it waited.
func (b *breaker) admit(ctx context.Context, rejected bool) (time.Duration, error) {
	start := time.Now()
	if err := b.waitUp(ctx); err != nil {
		return time.Since(start), err
	}
	for {
		b.mu.Lock()
		changed, openedAt := b.changed, b.openedAt
		b.mu.Unlock()
		// State moves an expired open breaker to half-open.
		var wait time.Duration
		switch b.cb.State() {
		case gobreaker.StateClosed:
			return time.Since(start), nil
		case gobreaker.StateHalfOpen:
			if !rejected {
				return time.Since(start), nil
			}
			// The trials are running: wait for their verdict (bounded, in
			// case a trial outlives the open timeout).
			wait = b.timeout
		case gobreaker.StateOpen:
			wait = max(time.Until(openedAt.Add(b.timeout)), time.Millisecond)
		}
		rejected = false
		t := time.NewTimer(wait)
		select {
		case <-changed:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return time.Since(start), context.Cause(ctx)
		}
		t.Stop()
	}
}

// record notes an attempt's result in the failure streak and reports whether
// a retryable failure is an outage: the breaker is not closed and the streak
// holds failures of more than one message.
func (b *breaker) record(eventID string, err error) bool {
	b.mu.Lock()
	if !IsRetryable(err) {
		b.streakFirst, b.streakMulti = "", false
		b.mu.Unlock()
		return false
	}
	switch b.streakFirst {
	case "":
		b.streakFirst = eventID
	case eventID:
	default:
		b.streakMulti = true
	}
	multi := b.streakMulti
	b.mu.Unlock()
	return multi && b.cb.State() != gobreaker.StateClosed
}
