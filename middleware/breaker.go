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
// It opens when breaker.consecutive_failures different messages failed
// their first attempt with no attempt succeeding since (gobreaker's
// ReadyToTrip over the set below): a message failing again, or hanging
// again, adds nothing, since its earlier failure already put the blame on
// it, so a few flaky or hung messages never open it, while a dependency
// that fails every message does at the first messages it fails. While it is
// open no attempt runs: the message in hand waits, and since a subscription
// delivers its next message only after the current one is settled, the
// handler's intake pauses. After breaker.open_timeout, half_open_requests
// trial attempts run; the others keep waiting until the trials close or
// reopen the breaker. A message that has not failed yet takes a trial
// before one that has (a message failing again tells nothing about the
// dependency), and a message that has failed waits off its worker (see
// workerSlot), so that untried messages can reach the trial.
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
	// point at a dependency; failures of one message only point at the
	// message.
	streakFirst string
	streakMulti bool
	// newFailures holds the event ids of the messages that failed their
	// first attempt in the streak, up to threshold of them: the breaker
	// opens when it is full.
	newFailures map[string]bool
	threshold   int
	// untried counts the messages waiting for the breaker, or running its
	// trial, that had not failed before: they go first in half-open.
	untried int

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
		timeout:     cfg.OpenTimeout,
		gauge:       gauge,
		logger:      logger,
		name:        name,
		changed:     make(chan struct{}),
		newFailures: map[string]bool{},
		threshold:   cfg.ConsecutiveFailures,
	}
	b.cb = gobreaker.NewCircuitBreaker[[]*message.Message](gobreaker.Settings{
		Name:        name,
		MaxRequests: uint32(cfg.HalfOpenRequests),
		Timeout:     cfg.OpenTimeout,
		// Called under gobreaker's lock after a failure in the closed state,
		// which note has recorded: failures of threshold messages open it.
		ReadyToTrip: func(gobreaker.Counts) bool { return b.tripped() },
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
		b.resetStreak()
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

// stage is the breaker stage.
func (b *breaker) stage(next step) step {
	return func(m *inflight) error {
		ctx := m.msg.Context()
		d := m.d
		// d.attempts counts this delivery's attempts and, when the broker
		// schedules the retries, the earlier deliveries.
		w := &breakerWaiter{b: b, untried: d.attempts == 0, worker: m.lease.Worker}
		defer w.done()
		rejected := false
		for {
			waited, err := w.admit(ctx, rejected)
			d.held += waited
			if err != nil {
				return &shutdownError{cause: err}
			}
			called := false
			_, err = b.cb.Execute(func() ([]*message.Message, error) {
				called = true
				err := next(m)
				b.note(d, err)
				return nil, err
			})
			if !called {
				// The state changed between admit and Execute (open again, or
				// the half-open trials are taken): wait for the next change.
				rejected = true
				continue
			}
			// An attempt that handler_timeout ended counts for the breaker
			// like any failure (a dependency that hangs every call opens it,
			// and is then tried once per open_timeout rather than by every
			// worker) but is never taken for an outage: it uses up one of
			// its message's attempts.
			outage := b.outage(err) && !timedOut(err)
			if b.probes(ctx, err) { // the probe's verdict replaces the guess
				var took time.Duration
				err, took = b.judge(ctx, err)
				d.held += took
				return err
			}
			if outage {
				return &outageError{err: err}
			}
			return err
		}
	}
}

// breakerWaiter is one message waiting for the breaker.
type breakerWaiter struct {
	b       *breaker
	untried bool   // the message has not failed before: it goes first in half-open
	worker  Worker // its worker, given back while a message that failed waits; nil for none
	counted bool   // an untried waiter counted in b.untried
	paused  bool   // the worker is given back
}

// block is called before each wait: an untried message makes itself
// known, one that failed gives its worker to the next message.
func (w *breakerWaiter) block() {
	switch {
	case w.untried && !w.counted:
		w.counted = true
		w.b.addUntried(1)
	case !w.untried && !w.paused && w.worker != nil:
		w.paused = true
		w.worker.Pause()
	}
}

// done is called when the stage returns.
func (w *breakerWaiter) done() {
	if w.counted {
		w.b.addUntried(-1)
	}
}

// admit waits until the breaker may let an attempt through, or ctx ends,
// and takes a worker again if it gave its own back. rejected says the
// previous Execute was turned away. It returns how long it waited.
func (w *breakerWaiter) admit(ctx context.Context, rejected bool) (time.Duration, error) {
	start := time.Now()
	err := w.b.admit(ctx, rejected, w)
	if w.paused && err == nil {
		w.paused = false
		err = w.worker.Resume(ctx)
	}
	return time.Since(start), err
}

func (b *breaker) addUntried(n int) {
	b.mu.Lock()
	b.untried += n
	b.mu.Unlock()
}

// admit waits until the breaker may let w's attempt through, or ctx ends.
// rejected says the previous Execute was turned away.
func (b *breaker) admit(ctx context.Context, rejected bool, w *breakerWaiter) error {
	if err := b.waitUp(ctx, w); err != nil {
		return err
	}
	for {
		b.mu.Lock()
		changed, openedAt, untried := b.changed, b.openedAt, b.untried
		b.mu.Unlock()
		// State moves an expired open breaker to half-open.
		var wait time.Duration
		switch b.cb.State() {
		case gobreaker.StateClosed:
			return nil
		case gobreaker.StateHalfOpen:
			// The trial goes to a message that has not failed yet, when one
			// waits: one that failed before says little about the dependency.
			if !rejected && (w.untried || untried == 0) {
				return nil
			}
			// The trials are running: wait for their verdict (bounded, in
			// case a trial outlives the open timeout).
			wait = b.timeout
		case gobreaker.StateOpen:
			wait = max(time.Until(openedAt.Add(b.timeout)), time.Millisecond)
		}
		rejected = false
		w.block()
		if err := waitChanged(ctx, changed, wait); err != nil {
			return err
		}
	}
}

// waitChanged waits until changed is closed or d has passed, and returns
// ctx's cause when ctx ends first.
func waitChanged(ctx context.Context, changed <-chan struct{}, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-changed:
	case <-t.C:
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	return nil
}

// note records the result of an attempt of d's message, before gobreaker
// judges it: a success (or a permanent error: the dependency answered)
// ends the failure streak, a retryable failure extends it.
func (b *breaker) note(d *delivery, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !IsRetryable(err) {
		b.resetStreak()
		return
	}
	switch b.streakFirst {
	case "":
		b.streakFirst = d.eventID
	case d.eventID:
	default:
		b.streakMulti = true
	}
	// d.attempts is 1 on the first attempt of a first delivery (a broker
	// that schedules redeliveries counts the earlier ones in).
	if d.attempts == 1 && len(b.newFailures) < b.threshold {
		b.newFailures[d.eventID] = true
	}
}

// resetStreak ends the failure streak; b.mu is held.
func (b *breaker) resetStreak() {
	b.streakFirst, b.streakMulti = "", false
	clear(b.newFailures)
}

// tripped reports whether the streak opens the breaker.
func (b *breaker) tripped() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.newFailures) >= b.threshold
}

// outage reports whether a failure err is taken for a dependency outage:
// it is retryable, the breaker is not closed, and more than one message
// failed since the last success.
func (b *breaker) outage(err error) bool {
	b.mu.Lock()
	multi := b.streakMulti
	b.mu.Unlock()
	return IsRetryable(err) && multi && b.cb.State() != gobreaker.StateClosed
}
