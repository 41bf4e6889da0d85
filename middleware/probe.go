package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// ProbeFunc checks the dependencies a handler calls (a service, a database
// of its own, a queue): nil when they answer, an error when they do not. It
// must not depend on any message, and it should be cheap (a health endpoint,
// SELECT 1); each call is bounded by consumer.handler_timeout.
//
// With a probe (Handler.Probe) the breaker asks it after every retryable
// failure of an attempt, before the retry stage counts the failure against
// the message. A probe that fails puts the failure on the dependency: the
// attempt is not counted, the breaker opens, and no attempt of the handler
// runs until the probe, asked once per breaker.open_timeout, passes again;
// an outage of any length poisons nothing. A probe that passes puts the
// failure on the message, which is poisoned after retry.max_attempts as
// usual. Without a probe the breaker guesses from the failures it sees (see
// README.md, "Outage or bad message?"), which a single message in flight
// (an ordered handler on NATS) cannot tell apart.
type ProbeFunc func(ctx context.Context) error

// judge asks the probe whether a retryable failure err of an attempt is the
// dependency's. It returns the error the breaker stage hands on: an
// *outageError when the probe failed (the breaker is then held open until
// it passes), err unchanged otherwise, and how long the probe took.
func (b *breaker) judge(ctx context.Context, err error) (error, time.Duration) {
	start := time.Now()
	perr := b.ask(ctx)
	took := time.Since(start)
	if perr == nil || ctx.Err() != nil {
		return err, took
	}
	b.mu.Lock()
	wasDown := b.down
	b.down = true
	b.mu.Unlock()
	b.gauge.Set(BreakerOpen)
	if !wasDown {
		b.logger.Info("Dependency probe failed: circuit breaker open until it passes; the failed attempt is not counted against its message",
			watermill.LogFields{"handler": b.name, "err": err.Error(), "probe": perr.Error()})
	}
	return &outageError{err: fmt.Errorf("%w (dependency probe: %v)", err, perr)}, took
}

// ask runs the probe, bounded by probeTimeout.
func (b *breaker) ask(ctx context.Context) (err error) {
	ctx, cancel := context.WithTimeout(ctx, b.probeTimeout)
	defer cancel()
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("dependency probe panicked: %v", r)
		}
	}()
	return b.probe(ctx)
}

// waitUp returns once the dependency probe passes (at once when it has not
// failed), or when ctx ends. One waiter asks the probe, once per
// open_timeout; the others wait for its verdict. w is told before it waits.
func (b *breaker) waitUp(ctx context.Context, w *breakerWaiter) error {
	for {
		b.mu.Lock()
		if !b.down {
			b.mu.Unlock()
			return nil
		}
		changed, mine := b.changed, !b.probing
		b.probing = true
		b.mu.Unlock()
		w.block()
		if !mine {
			if err := waitChanged(ctx, changed, b.timeout); err != nil {
				return err
			}
			continue
		}
		err := sleepFor(ctx, b.timeout)
		if err == nil {
			err = b.ask(ctx)
		}
		b.mu.Lock()
		b.probing = false
		up := err == nil
		if up {
			b.down = false
			close(b.changed)
			b.changed = make(chan struct{})
		}
		b.mu.Unlock()
		switch {
		case up:
			b.gauge.Set(gaugeOf(b.cb.State()))
			b.logger.Info("Dependency probe passed: attempts run again", watermill.LogFields{"handler": b.name})
			return nil
		case ctx.Err() != nil:
			return context.Cause(ctx)
		default:
			b.logger.Debug("Dependency probe still failing", watermill.LogFields{"handler": b.name, "probe": err.Error()})
		}
	}
}

// probes reports whether a retryable failure err of an attempt is one to ask
// the probe about: not an attempt that handler_timeout ended (never an
// outage, see the breaker stage), not millrace's own database (the retry
// stage waits for it), not a stop.
func (b *breaker) probes(ctx context.Context, err error) bool {
	return b.probe != nil && IsRetryable(err) && ctx.Err() == nil &&
		!timedOut(err) && !errors.As(err, new(*unavailableError)) && !errors.As(err, new(*shutdownError))
}

// breakerEnabledPath is the YAML path that turned handler's breaker off:
// its override under consumer.handlers, or consumer.breaker.enabled.
func breakerEnabledPath(cfg Config, handler string) string {
	if o, ok := cfg.Handlers[handler]; ok && o.Breaker.Enabled != nil {
		return "consumer.handlers." + handler + ".breaker.enabled"
	}
	return "consumer.breaker.enabled"
}
