package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v5"
)

// jitterFactor spreads each wait over [wait*(1-f), wait*(1+f)] when
// retry.jitter is on (cenkalti/backoff's default randomization factor).
const jitterFactor = 0.5

// newBackOff returns the configured exponential backoff, reset.
func newBackOff(cfg RetryConfig) *backoff.ExponentialBackOff {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = cfg.InitialInterval
	bo.Multiplier = cfg.Multiplier
	bo.MaxInterval = cfg.MaxInterval
	bo.RandomizationFactor = 0
	if *cfg.Jitter {
		bo.RandomizationFactor = jitterFactor
	}
	bo.Reset()
	return bo
}

// retry runs the rest of the chain until it succeeds, fails permanently, or
// the message has used retry.max_attempts or retry.max_elapsed; then it
// returns an error the poison queue takes (shouldPoison). Waits use the
// message's context, so a shutdown ends them with a *shutdownError (nack,
// never poison), and so does a failed attempt that ends after the stop (an
// attempt keeps running through a stop, for up to handler_timeout). A
// failure the breaker attributes to a dependency outage
// (*outageError) does not use up the message's retries: the next attempt
// waits in the breaker stage instead. Nor does a database the inbox
// transaction could not reach (*unavailableError): the attempt is repeated
// after the backoff's next wait. An attempt that handler_timeout ended
// (*abandonedError, *timedOutError) is a failed attempt like any other.
//
// With retry.mode auto, when the message came from a broker that
// schedules redeliveries (its Lease carries a delivery number: see
// consumer.BrokerSource) and the handler is not ordered, a failed attempt that
// will be retried is not waited for here: the stage returns a
// *redeliverError, the message is nacked and the broker delivers it again
// after RedeliveryWait of its delivery number, so the worker is free
// meanwhile. The attempt number is
// then the broker's delivery number, which survives consumer restarts, and
// the message is poisoned when its max_attempts-th delivery fails;
// max_elapsed is not applied (no process sees every wait). The outage and
// unavailable-database waits above stay in process: they do not use up
// attempts, and the delivery count cannot be given back.
//
// The backoff between two attempts in process holds no worker (offWorker):
// the messages behind one that keeps failing or hanging are not held back.
//
// Written here instead of using Watermill's Retry middleware, which advances
// the backoff once more for every ShouldRetry and OnRetryHook call (the ladder
// you get is not the one configured), cannot keep an outage from using up
// attempts, and runs attempts on the message's own context (issue #467).
// The intervals still come from cenkalti/backoff.
func (c *Chain) retry(next step) step {
	cfg := c.cfg.Retry
	return func(m *inflight) error {
		ctx := m.msg.Context()
		d := m.d
		delivery := m.lease.Delivery
		scheduled := !*c.cfg.Ordered && cfg.Mode == RetryAuto && delivery >= 1
		if scheduled {
			d.attempts = delivery - 1 // at least one attempt per earlier delivery
		}
		bo := newBackOff(cfg)
		start := c.stack.now()
		counted := 0
		for {
			if err := ctx.Err(); err != nil {
				return &shutdownError{cause: context.Cause(ctx)}
			}
			err := next(m)
			if !IsRetryable(err) {
				if err != nil {
					d.failed(err, c.stack.now())
				}
				return err
			}
			var sd *shutdownError
			if errors.As(err, &sd) {
				return err
			}
			if ctx.Err() != nil {
				// The consumer stopped during the attempt. A stop is never a
				// reason to poison, and a failure seen while stopping may be
				// the stop's doing: return the message for redelivery, where
				// its attempts start over.
				return &shutdownError{cause: fmt.Errorf("%w (the attempt running at the stop failed: %v)", context.Cause(ctx), err)}
			}
			now := c.stack.now()
			d.failed(err, now)
			var outage *outageError
			if errors.As(err, &outage) {
				c.stack.logger.Info("Attempt failed while the circuit breaker is open; waiting for it, retries not used up",
					c.logFields(d, watermill.LogFields{"err": err.Error()}))
				continue
			}
			var down *unavailableError
			if errors.As(err, &down) {
				wait := bo.NextBackOff()
				c.stack.logger.Info("Database unreachable; waiting, retries not used up",
					c.logFields(d, watermill.LogFields{"err": err.Error(), "wait": wait.String()}))
				if err := c.stack.sleep(ctx, wait); err != nil {
					return &shutdownError{cause: err}
				}
				d.held += wait
				continue
			}
			counted++
			if scheduled {
				if delivery >= cfg.MaxAttempts {
					return &exhaustedError{attempts: d.attempts, err: err}
				}
				d.outcome = OutcomeRetried
				c.stack.logger.Info("Attempt failed; the broker delivers the message again after its backoff", c.logFields(d, watermill.LogFields{
					"err": err.Error(), "delivery": delivery, "max_attempts": cfg.MaxAttempts,
				}))
				return &redeliverError{delivery: delivery, err: err}
			}
			wait := bo.NextBackOff()
			elapsed := now.Sub(start) - d.held
			if counted >= cfg.MaxAttempts || elapsed+wait > cfg.MaxElapsed {
				return &exhaustedError{attempts: d.attempts, err: err}
			}
			c.counter(OutcomeRetried).Inc()
			c.stack.logger.Info("Attempt failed, retrying", c.logFields(d, watermill.LogFields{
				"err": err.Error(), "wait": wait.String(), "max_attempts": cfg.MaxAttempts,
			}))
			if err := offWorker(ctx, m.lease.Worker, func() error { return c.stack.sleep(ctx, wait) }); err != nil {
				return &shutdownError{cause: err}
			}
		}
	}
}

// RedeliveryWait is the wait after the failed attempt number attempt (1 for
// the first) on the retry ladder: retry.initial_interval times
// retry.multiplier per further attempt, capped at retry.max_interval,
// jittered when retry.jitter is on. A broker that schedules redeliveries
// (see consumer.BrokerSource) waits it before delivering a message
// again, attempt being the number of the delivery that failed.
func (c *Chain) RedeliveryWait(attempt int) time.Duration {
	bo := newBackOff(c.cfg.Retry)
	wait := bo.NextBackOff()
	// Past maxLadderSteps every step is at max_interval for any multiplier
	// that reaches it; the bound keeps a huge delivery count cheap.
	const maxLadderSteps = 64
	for i := 1; i < min(attempt, maxLadderSteps); i++ {
		wait = bo.NextBackOff()
	}
	return wait
}
