package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

// A dependency is down for 10s: the breaker opens, nothing is poisoned, the
// handler is not called in a hot loop while it is open, and every event is
// processed once the dependency is back. On gochannel and on RabbitMQ with
// four competing consumers.
func TestBreakerHoldsMessagesDuringAnOutage(t *testing.T) {
	t.Parallel()
	testkit.Each(t, []string{"gochannel", "rabbitmq"}, func(t *testing.T, name string) {
		testOutage(t, name)
	})
}

func testOutage(t *testing.T, broker string) {
	const (
		events  = 40
		outage  = 10 * time.Second
		workers = 4
	)
	e, k, topic, group := newBilling(t, broker, kitOptions{})

	d := &downDependency{second: make(chan struct{})}
	handle := func(msg *message.Message) error {
		if err := d.call(msg); err != nil {
			return err
		}
		return e.write(msg.Context(), group, msg)
	}
	cfg := middleware.Config{
		Workers: workers,
		Breaker: middleware.BreakerConfig{ConsecutiveFailures: 3, OpenTimeout: time.Second},
		Retry: middleware.RetryConfig{
			MaxAttempts: 3, InitialInterval: 50 * time.Millisecond, MaxInterval: 200 * time.Millisecond, MaxElapsed: time.Minute,
		},
	}
	msgs := make([]*message.Message, events)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("evt-%02d", i), fmt.Sprintf("o-%d", i), 1, `{"amount":1}`)
	}
	publish(t, k.pub, topic, msgs...)

	d.upAt.Store(time.Now().Add(outage).UnixNano())
	c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: handle})

	require.True(t, watchBreakerWhileDown(t, c, d), "the breaker opened during the outage")

	testkit.Eventually(t, time.Minute, "every event processed after recovery", func() bool {
		// An outcome is counted once its attempt has returned through the
		// chain, after the COMMIT that shows its row.
		return e.rows(t, "business", "") == events &&
			c.messages(t, "billing", middleware.OutcomeOK) >= events
	})
	require.Zero(t, c.messages(t, "billing", middleware.OutcomePoisoned))
	require.Zero(t, e.rows(t, "millrace_poison", ""))
	require.EqualValues(t, events, c.messages(t, "billing", middleware.OutcomeOK))
	testkit.Eventually(t, 10*time.Second, "the breaker closed", func() bool {
		return c.metric(t, middleware.MetricBreakerState, map[string]string{"handler": "billing"}) == middleware.BreakerClosed
	})

	// Without the breaker, four workers retrying every 200ms at most would
	// call the handler hundreds of times in 10s. With it: the failures that
	// open it (each in-flight message's attempts at most), then one trial
	// per open period.
	bound := int64(workers*cfg.Retry.MaxAttempts + int(outage/cfg.Breaker.OpenTimeout) + workers)
	require.LessOrEqual(t, d.callsWhileDown.Load(), bound, "handler calls while the dependency was down")
	t.Logf("handler calls while down: %d (bound %d), in all: %d", d.callsWhileDown.Load(), bound, d.calls.Load())
}

// downDependency is a dependency that is down until upAt. The outage is
// seen by several messages in flight: the first failing call waits (a
// bounded while) for a second message to arrive, as in a consumer with a
// backlog. One message failing alone is a different case
// (TestBreakerDoesNotShieldABadMessage).
type downDependency struct {
	upAt                  atomic.Int64 // unix nanos when the dependency comes back
	callsWhileDown, calls atomic.Int64
	second                chan struct{}
	secondOnce            sync.Once
	firstID               atomic.Value
}

// call calls the dependency for msg: an error while it is down.
func (d *downDependency) call(msg *message.Message) error {
	d.calls.Add(1)
	if time.Now().UnixNano() >= d.upAt.Load() {
		return nil
	}
	d.callsWhileDown.Add(1)
	id := msg.Metadata.Get(bus.EventIDKey)
	if d.firstID.CompareAndSwap(nil, id) {
		select {
		case <-d.second:
		case <-time.After(10 * time.Second):
		}
	} else if d.firstID.Load() != id {
		d.secondOnce.Do(func() { close(d.second) })
	}
	return errors.New("inventory service unavailable")
}

// watchBreakerWhileDown checks that nothing is poisoned while d is down
// and reports whether the breaker was seen open meanwhile.
func watchBreakerWhileDown(t *testing.T, c *testConsumer, d *downDependency) bool {
	sawOpen := false
	for time.Now().UnixNano() < d.upAt.Load() {
		if c.metric(t, middleware.MetricBreakerState, map[string]string{"handler": "billing"}) == middleware.BreakerOpen {
			sawOpen = true
		}
		require.Zero(t, c.messages(t, "billing", middleware.OutcomePoisoned), "nothing is poisoned during the outage")
		time.Sleep(20 * time.Millisecond)
	}
	return sawOpen
}

// One message failing alone with a retryable error is a bad message, not an
// outage, even when its failures open the breaker: it is poisoned after
// retry.max_attempts, and the messages behind it flow again.
func TestBreakerDoesNotShieldABadMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	k := gochannelKit(t)
	topic, group := uniqueName(t, "orders"), uniqueName(t, "billing")
	cfg := middleware.Config{
		Workers: 1, Ordered: new(true),
		Breaker: middleware.BreakerConfig{ConsecutiveFailures: 2, OpenTimeout: 200 * time.Millisecond},
		// Parking off, so that o-1's messages behind the bad one flow.
		Poison: middleware.PoisonConfig{Park: new(false)},
	}
	fastRetry(&cfg, 4)
	c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: func(msg *message.Message) error {
		if msg.Metadata.Get(bus.EventIDKey) == "bad" {
			return errors.New("index out of range in tax rules")
		}
		return e.write(msg.Context(), group, msg)
	}})
	publish(t, k.pub, topic, event("bad", "o-1", 1, `{}`))
	testkit.Eventually(t, 30*time.Second, "the bad message poisoned", func() bool {
		return c.messages(t, "billing", middleware.OutcomePoisoned) == 1
	})
	for i := range 5 {
		publish(t, k.pub, topic, event(fmt.Sprintf("good-%d", i), "o-1", int64(2+i), `{}`))
	}
	testkit.Eventually(t, 30*time.Second, "the messages behind it processed", func() bool {
		return e.rows(t, "business", "") == 5
	})
	var attempts int
	require.NoError(t, e.db.QueryRow(`SELECT attempts FROM `+e.table("millrace_poison")+` WHERE event_id = 'bad'`).Scan(&attempts))
	require.Equal(t, 4, attempts)
}

// Only a message's first failed attempt counts toward opening the breaker:
// one message failing all its attempts, then another doing the same, never
// open a breaker that takes three messages, however many attempts failed in
// a row; a success in between starts the count again; three new messages
// failing open it, and the third then waits for it (an outage) instead of
// using up its attempts.
func TestBreakerCountsMessagesNotAttempts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := middleware.Config{Breaker: middleware.BreakerConfig{ConsecutiveFailures: 3, OpenTimeout: time.Minute}}
	fastRetry(&cfg, 4)
	handle, c := chainOn(t, e, cfg, func(msg *message.Message) error {
		if msg.Metadata.Get(bus.EventIDKey) == "good" {
			return e.write(msg.Context(), "billing", msg)
		}
		return errors.New("pricing service answered 503")
	})
	state := func() float64 {
		return c.metric(t, middleware.MetricBreakerState, map[string]string{"handler": "billing"})
	}
	for _, id := range []string{"bad-1", "bad-2", "good", "bad-3", "bad-4"} {
		require.NoError(t, handle(event(id, "o-"+id, 1, `{}`)), id)
		require.EqualValues(t, middleware.BreakerClosed, state(), "after %s: attempts failed in a row, but of at most two new messages", id)
	}
	require.EqualValues(t, 4, c.messages(t, "billing", middleware.OutcomePoisoned), "each bad one poisoned after its attempts")

	ctx, stop := context.WithCancel(context.Background())
	last := event("bad-5", "o-bad-5", 1, `{}`)
	last.SetContext(ctx)
	returned := make(chan error, 1)
	go func() { returned <- handle(last) }()
	testkit.Eventually(t, 30*time.Second, "the breaker open", func() bool { return state() == middleware.BreakerOpen })
	stop()
	require.Error(t, <-returned, "held for the breaker, then nacked by the stop")
	require.EqualValues(t, 4, c.messages(t, "billing", middleware.OutcomePoisoned), "bad-5 was not poisoned")
}
