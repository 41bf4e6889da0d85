package middleware

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
)

// fakeClock replaces the Stack's clock: sleeps return at once and advance now.
type fakeClock struct {
	now    time.Time
	sleeps []time.Duration
}

func (f *fakeClock) install(s *Stack) {
	f.now = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	s.now = func() time.Time { return f.now }
	s.sleep = func(ctx context.Context, d time.Duration) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		f.sleeps = append(f.sleeps, d)
		f.now = f.now.Add(d)
		return nil
	}
}

// retryChain is a chain without database or breaker, for the retry stage alone.
func retryChain(t *testing.T, retry RetryConfig) (*Chain, *fakeClock) {
	t.Helper()
	gc := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { gc.Close() })
	s, err := New(Config{
		Retry:   retry,
		Breaker: BreakerConfig{Enabled: new(false)},
		Inbox:   InboxConfig{Enabled: new(false)},
		Poison:  PoisonConfig{Destination: PoisonToTopic, Topic: "poison"},
	}, Deps{PoisonPublisher: gc})
	require.NoError(t, err)
	clock := &fakeClock{}
	clock.install(s)
	c, err := s.Chain(Handler{Name: "h", Topic: "orders", ConsumerGroup: "g"})
	require.NoError(t, err)
	return c, clock
}

// runRetry runs the retry stage over h for a message; with scheduled, its
// subscription recorded scheduled[0] as its delivery number, which the
// Dispatcher lends the chain in the message's Lease.
func runRetry(ctx context.Context, c *Chain, h step, scheduled ...int) (*delivery, error) {
	msg := message.NewMessage("evt-1", nil)
	var lease Lease
	for _, n := range scheduled {
		lease.Delivery = n
	}
	d := &delivery{eventID: "evt-1"}
	msg.SetContext(ctx)
	err := c.retry(c.attempt(h))(&inflight{msg: msg, d: d, lease: lease})
	return d, err
}

func TestRetryFollowsTheConfiguredLadder(t *testing.T) {
	t.Parallel()
	c, clock := retryChain(t, RetryConfig{
		MaxAttempts: 6, InitialInterval: 100 * time.Millisecond, Multiplier: 2, MaxInterval: 500 * time.Millisecond,
		MaxElapsed: time.Hour, Jitter: new(false),
	})
	calls := 0
	d, err := runRetry(context.Background(), c, func(*inflight) error {
		calls++
		return errors.New("down")
	})
	require.Equal(t, 6, calls)
	require.Equal(t, []time.Duration{100, 200, 400, 500, 500}, scaled(clock.sleeps, time.Millisecond),
		"one step per failure, capped at max_interval (Watermill's Retry would step twice per failure with ShouldRetry)")
	require.True(t, shouldPoison(err))
	require.EqualError(t, err, "6 attempts failed, last: down")
	require.Equal(t, 6, d.attempts)
	require.Equal(t, 1700*time.Millisecond, d.lastFailure.Sub(d.firstFailure))
}

func scaled(ds []time.Duration, unit time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d / unit
	}
	return out
}

func TestRetryJitterStaysWithinHalfTheInterval(t *testing.T) {
	t.Parallel()
	c, clock := retryChain(t, RetryConfig{
		MaxAttempts: 40, InitialInterval: time.Second, Multiplier: 1, MaxInterval: time.Second, MaxElapsed: time.Hour,
	})
	_, _ = runRetry(context.Background(), c, func(*inflight) error {
		return errors.New("down")
	})
	require.Len(t, clock.sleeps, 39)
	distinct := map[time.Duration]bool{}
	for _, s := range clock.sleeps {
		require.GreaterOrEqual(t, s, 500*time.Millisecond)
		require.LessOrEqual(t, s, 1500*time.Millisecond)
		distinct[s] = true
	}
	require.Greater(t, len(distinct), 1, "the waits are spread")
}

func TestRetryStopsAtMaxElapsed(t *testing.T) {
	t.Parallel()
	c, clock := retryChain(t, RetryConfig{
		MaxAttempts: 100, InitialInterval: time.Second, Multiplier: 2, MaxInterval: time.Minute,
		MaxElapsed: 10 * time.Second, Jitter: new(false),
	})
	d, err := runRetry(context.Background(), c, func(*inflight) error {
		return errors.New("down")
	})
	// 1s, 2s, 4s waited (7s); the next wait (8s) would pass 10s.
	require.Equal(t, []time.Duration{1, 2, 4}, scaled(clock.sleeps, time.Second))
	require.Equal(t, 4, d.attempts)
	require.True(t, shouldPoison(err))
}

func TestRetrySkipsPermanentErrorsAndStopsOnShutdown(t *testing.T) {
	t.Parallel()
	c, clock := retryChain(t, RetryConfig{MaxAttempts: 5, Jitter: new(false)})
	calls := 0
	_, err := runRetry(context.Background(), c, func(*inflight) error {
		calls++
		return adapters.Permanent(errors.New("negative total"))
	})
	require.Equal(t, 1, calls)
	require.Empty(t, clock.sleeps)
	require.True(t, shouldPoison(err))

	ctx, cancel := context.WithCancel(context.Background())
	calls = 0
	_, err = runRetry(ctx, c, func(m *inflight) error {
		calls++
		cancel() // the consumer stops during the first attempt
		require.NoError(t, m.msg.Context().Err(), "a running attempt is not cancelled by the stop")
		return errors.New("down")
	})
	require.Equal(t, 1, calls)
	var sd *shutdownError
	require.ErrorAs(t, err, &sd)
	require.False(t, shouldPoison(err), "a stop never poisons")
}

func TestAttemptRestoresTheMessageContext(t *testing.T) {
	t.Parallel()
	c, _ := retryChain(t, RetryConfig{MaxAttempts: 3, Jitter: new(false)})
	var seen []context.Context
	msg := message.NewMessage("evt-1", nil)
	orig := context.WithValue(context.Background(), struct{}{}, "the message's own")
	msg.SetContext(orig)
	err := c.retry(c.attempt(func(m *inflight) error {
		seen = append(seen, m.msg.Context())
		_, hasDeadline := m.msg.Context().Deadline()
		require.True(t, hasDeadline, "each attempt is bounded by handler_timeout")
		require.NoError(t, m.msg.Context().Err(), "an attempt never starts on a cancelled context (Watermill #467)")
		if len(seen) < 3 {
			return errors.New("down")
		}
		return nil
	}))(&inflight{msg: msg, d: &delivery{eventID: "evt-1"}})
	require.NoError(t, err)
	require.Len(t, seen, 3)
	require.Equal(t, orig, msg.Context())
	for _, ctx := range seen {
		require.Error(t, ctx.Err(), "the attempt's context ended with the attempt")
	}
}

// A message whose broker schedules redeliveries (its subscription recorded
// a delivery number for it) is not waited for in process: each failed delivery
// before the max_attempts-th is handed back for redelivery, that one is
// poisoned with the attempts of every delivery. An ordered handler, and
// any with retry.mode process, keeps its retries in process.
func TestRetryHandsTheWaitToTheBroker(t *testing.T) {
	t.Parallel()
	ladder := RetryConfig{
		MaxAttempts: 3, InitialInterval: 100 * time.Millisecond, Multiplier: 2, MaxInterval: 300 * time.Millisecond,
		MaxElapsed: time.Hour, Jitter: new(false),
	}
	c, clock := retryChain(t, ladder)
	fail := func(*inflight) error { return errors.New("down") }
	for delivery := 1; delivery <= 3; delivery++ {
		d, err := runRetry(context.Background(), c, fail, delivery)
		require.Empty(t, clock.sleeps, "no wait in process")
		if delivery < 3 {
			require.ErrorAs(t, err, new(*redeliverError))
			require.False(t, shouldPoison(err))
			require.Equal(t, OutcomeRetried, d.outcome)
			continue
		}
		require.True(t, shouldPoison(err), "poisoned on delivery max_attempts: %v", err)
		require.Equal(t, 3, d.attempts)
	}
	require.Equal(t, []time.Duration{100, 200, 300, 300}, scaled([]time.Duration{
		c.RedeliveryWait(1), c.RedeliveryWait(2), c.RedeliveryWait(3), c.RedeliveryWait(1 << 30),
	}, time.Millisecond), "the retry ladder by attempt number")

	// A stop during an attempt is never a reason to poison, on any delivery.
	ctx, cancel := context.WithCancel(context.Background())
	_, err := runRetry(ctx, c, func(*inflight) error {
		cancel()
		return errors.New("down")
	}, 3)
	require.ErrorAs(t, err, new(*shutdownError))
	require.False(t, shouldPoison(err))

	ordered, clock := retryChain(t, ladder)
	ordered.cfg.Ordered = new(true)
	_, err = runRetry(context.Background(), ordered, fail, 1)
	require.True(t, shouldPoison(err))
	require.Len(t, clock.sleeps, 2, "an ordered handler waits in process")

	inProcess := ladder
	inProcess.Mode = RetryInProcess
	worker, clock := retryChain(t, inProcess)
	_, err = runRetry(context.Background(), worker, fail, 1)
	require.True(t, shouldPoison(err))
	require.Len(t, clock.sleeps, 2, "retry.mode process waits in process")
}
