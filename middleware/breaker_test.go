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
	e, k, topic, group := newBilling(t, "gochannel", kitOptions{})
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

// dependency is what a handler and its probe call in these tests: up or
// down as the test says.
type dependency struct {
	down                          atomic.Bool
	calls, callsWhileDown, probes atomic.Int64
}

func (d *dependency) call() error {
	d.calls.Add(1)
	if d.down.Load() {
		d.callsWhileDown.Add(1)
		return errors.New("inventory service unavailable")
	}
	return nil
}

func (d *dependency) probe(context.Context) error {
	d.probes.Add(1)
	if d.down.Load() {
		return errors.New("inventory service: connection refused")
	}
	return nil
}

// An ordered handler on RabbitMQ and on NATS (one message in flight) with the
// default retry and breaker settings rides out a 60s dependency outage: the
// probe puts the failure on the dependency, nothing is poisoned, the handler
// is not called while the probe fails, and every event is processed in order
// after recovery. A message that fails while the probe passes, in the same
// run, is still poisoned after retry.max_attempts.
func TestProbeRidesOutALongOutageBehindAnOrderedHandler(t *testing.T) {
	t.Parallel()
	testkit.Each(t, []string{bus.KindRabbitMQ, bus.KindNATS}, func(t *testing.T, kind string) {
		const outage = 60 * time.Second
		e, k, topic, group := newBilling(t, kind, kitOptions{ackWait: 5 * time.Minute})

		var dep dependency
		dep.down.Store(true)
		handle := func(msg *message.Message) error {
			if err := dep.call(); err != nil {
				return err
			}
			if msg.Metadata.Get(bus.EventIDKey) == "bad" {
				return errors.New("tax rules: index out of range") // retryable, and about this message only
			}
			return e.write(msg.Context(), group, msg)
		}
		var msgs []*message.Message
		for v := range 10 {
			for a := range 3 {
				msgs = append(msgs, event(fmt.Sprintf("evt-%d-%d", a, v), fmt.Sprintf("o-%d", a), int64(v+1), `{}`))
			}
			if v == 4 {
				msgs = append(msgs, event("bad", "o-bad", 1, `{}`))
			}
		}
		publish(t, k.pub, topic, msgs...)
		cfg := middleware.Config{Ordered: new(true)} // retry and breaker at their defaults
		c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: handle, probe: dep.probe})

		labels := map[string]string{"handler": "billing"}
		testkit.Eventually(t, 30*time.Second, "the breaker open on the first failure", func() bool {
			return c.metric(t, middleware.MetricBreakerState, labels) == middleware.BreakerOpen
		})
		deadline := time.Now().Add(outage)
		for time.Now().Before(deadline) {
			require.Zero(t, c.messages(t, "billing", middleware.OutcomePoisoned), "nothing is poisoned during the outage")
			require.EqualValues(t, middleware.BreakerOpen, c.metric(t, middleware.MetricBreakerState, labels), "the breaker stays open while the probe fails")
			time.Sleep(100 * time.Millisecond)
		}
		probesWhileDown := dep.probes.Load()
		dep.down.Store(false)

		good := len(msgs) - 1
		testkit.Eventually(t, 2*time.Minute, "every good event processed after recovery", func() bool {
			return e.rows(t, "business", "") == good &&
				c.messages(t, "billing", middleware.OutcomePoisoned) == 1 &&
				c.messages(t, "billing", middleware.OutcomeOK) >= float64(good) // counted after the COMMIT
		})
		require.EqualValues(t, 1, dep.callsWhileDown.Load(), "the handler was called once while the dependency was down: the attempt that found it")
		def := middleware.Config{}.WithDefaults()
		// The first failure's probe, then one per open_timeout.
		require.LessOrEqual(t, probesWhileDown, int64(outage/def.Breaker.OpenTimeout)+2, "the probe is asked once per open_timeout while it fails")
		var id string
		var attempts int
		require.NoError(t, e.db.QueryRow(`SELECT event_id, attempts FROM `+e.table("millrace_poison")).Scan(&id, &attempts))
		require.Equal(t, "bad", id)
		require.Equal(t, def.Retry.MaxAttempts, attempts, "the bad message used its attempts, and only those made while the probe passed")
		require.Zero(t, e.count(t, `SELECT count(*) FROM (SELECT version < lag(version) OVER (PARTITION BY aggregate_id ORDER BY seq) AS back FROM `+
			e.table("business")+`) v WHERE back`), "events of an aggregate in version order")
		require.EqualValues(t, good, c.messages(t, "billing", middleware.OutcomeOK))
	})
}

// On Kafka, a consumer whose breaker holds messages (the probe failing) for
// longer than the group's rebalance timeout while a second consumer of the
// group joins lets go of them when its session ends (their contexts end),
// so it stays in the group, and once the dependency is back every event is
// processed, in order per aggregate, and nothing is poisoned.
func TestProbeHoldOutlastsAKafkaRebalance(t *testing.T) {
	t.Parallel()
	// Well above the kit's 2s heartbeat interval: a member learns of a
	// rebalance at its next heartbeat, and has to rejoin within this.
	const rebalanceTimeout = 5 * time.Second
	e, k, topic, group := newBilling(t, bus.KindKafka, kitOptions{rebalanceTimeout: rebalanceTimeout})

	var dep dependency
	dep.down.Store(true)
	handle := func(msg *message.Message) error {
		if err := dep.call(); err != nil {
			return err
		}
		return e.write(msg.Context(), group, msg)
	}
	var msgs []*message.Message
	for v := range 5 {
		for a := range 4 {
			msgs = append(msgs, event(fmt.Sprintf("evt-%d-%d", a, v), fmt.Sprintf("o-%d", a), int64(v+1), `{}`))
		}
	}
	publish(t, k.pub, topic, msgs...)
	cfg := middleware.Config{Ordered: new(true)}
	spec := handlerSpec{name: "billing", topic: topic, group: group, handle: handle, probe: dep.probe}
	first := startConsumer(t, k, e, cfg, spec)
	labels := map[string]string{"handler": "billing"}
	testkit.Eventually(t, 30*time.Second, "the breaker open on the first failure", func() bool {
		return first.metric(t, middleware.MetricBreakerState, labels) == middleware.BreakerOpen
	})
	second := startConsumer(t, k, e, cfg, spec)
	time.Sleep(2 * rebalanceTimeout)
	dep.down.Store(false)

	testkit.Eventually(t, time.Minute, "every event processed after recovery", func() bool {
		return e.rows(t, "business", "") == len(msgs)
	})
	for _, c := range []*testConsumer{first, second} {
		require.Zero(t, c.messages(t, "billing", middleware.OutcomePoisoned), "nothing is poisoned")
	}
	require.Zero(t, e.count(t, `SELECT count(*) FROM (SELECT version < lag(version) OVER (PARTITION BY aggregate_id ORDER BY seq) AS back FROM `+
		e.table("business")+`) v WHERE back`), "events of an aggregate in version order")
}

// Two messages failing in a row with the breaker open look like an outage to
// the breaker's guess (TestBreakerHoldsMessagesDuringAnOutage); with a probe
// that passes they are bad messages: each is poisoned after its attempts and
// the flow goes on.
func TestProbeThatPassesPutsFailuresOnTheMessages(t *testing.T) {
	t.Parallel()
	e, k, topic, group := newBilling(t, "gochannel", kitOptions{})
	cfg := middleware.Config{
		Workers: 2,
		Breaker: middleware.BreakerConfig{ConsecutiveFailures: 2, OpenTimeout: 100 * time.Millisecond},
	}
	fastRetry(&cfg, 3)
	var dep dependency
	c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, probe: dep.probe, handle: func(msg *message.Message) error {
		if id := msg.Metadata.Get(bus.EventIDKey); id == "bad-1" || id == "bad-2" {
			return errors.New("index out of range in tax rules")
		}
		return e.write(msg.Context(), group, msg)
	}})
	publish(t, k.pub, topic, event("bad-1", "o-1", 1, `{}`), event("bad-2", "o-2", 1, `{}`), event("good", "o-3", 1, `{}`))
	testkit.Eventually(t, 30*time.Second, "both bad messages poisoned, the good one processed", func() bool {
		return c.messages(t, "billing", middleware.OutcomePoisoned) == 2 && e.rows(t, "business", "") == 1
	})
	require.Positive(t, dep.probes.Load())
	require.Equal(t, 2, e.rows(t, "millrace_poison", `attempts = 3`))
}

// A probe needs the breaker: a chain with one and the breaker off is refused,
// naming the key that turned it off.
func TestProbeNeedsTheBreaker(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	probe := func(context.Context) error { return nil }
	for _, tc := range []struct {
		cfg  middleware.Config
		path string
	}{
		{middleware.Config{Breaker: middleware.BreakerConfig{Enabled: new(false)}}, "consumer.breaker.enabled"},
		{middleware.Config{Handlers: map[string]middleware.Config{"billing": {Breaker: middleware.BreakerConfig{Enabled: new(false)}}}},
			"consumer.handlers.billing.breaker.enabled"},
	} {
		stack, err := middleware.New(tc.cfg, middleware.Deps{DB: e.db, Schema: e.schema})
		require.NoError(t, err)
		_, err = stack.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "billing", Probe: probe})
		require.ErrorContains(t, err, `handler "billing": a dependency probe needs the circuit breaker, but `+tc.path+" is false")
		_, err = stack.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "billing"})
		require.NoError(t, err, "without a probe the breaker may be off")
	}
}
