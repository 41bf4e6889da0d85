package adaptertest

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// OrderLedger is an ordered handler's view of what it handled, for the
// tests of an ordered subscription (adapters.Capabilities.OrderedFlight):
// per aggregate the last sequence number with an effect, as an inbox and an
// effect table would keep it. A delivery at or below it is a duplicate (the inbox drops it); one
// above the next is an order violation, and so is a second message of an
// aggregate handed out while one is in flight.
type OrderLedger struct {
	mu         sync.Mutex
	last       map[string]int
	busy       map[string]bool
	nacked     map[string]bool // ids nacked once, on purpose
	handled    int             // deliveries with an effect
	running    int             // handler calls under way, all aggregates
	maxRunning int             // the most running at once
	dups       int
	violations []string
	progress   chan int // handled, after each effect
}

// NewOrderLedger returns an empty ledger.
func NewOrderLedger() *OrderLedger {
	return &OrderLedger{last: map[string]int{}, busy: map[string]bool{}, nacked: map[string]bool{}, progress: make(chan int, 1<<16)}
}

// Handle is the handler: it sleeps latency (a database round trip), nacks
// the first delivery of every nackEvery-th event published (0: none), and
// acks the rest.
func (l *OrderLedger) Handle(msg *message.Message, latency time.Duration, nackEvery int) {
	agg := msg.Metadata.Get(envelope.AggregateIDKey)
	seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
	idx, _ := strconv.Atoi(msg.Metadata.Get("idx"))
	l.mu.Lock()
	if l.busy[agg] {
		l.violations = append(l.violations, fmt.Sprintf("%s: seq %d handed out while another was in flight", agg, seq))
	}
	l.busy[agg] = true
	l.running++
	l.maxRunning = max(l.maxRunning, l.running)
	l.mu.Unlock()
	time.Sleep(latency)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.busy[agg] = false
	l.running--
	switch {
	case seq <= l.last[agg]:
		l.dups++
	case seq != l.last[agg]+1:
		l.violations = append(l.violations, fmt.Sprintf("%s: seq %d after %d", agg, seq, l.last[agg]))
	case nackEvery > 0 && idx%nackEvery == 0 && !l.nacked[msg.UUID]:
		l.nacked[msg.UUID] = true
		msg.Nack()
		return
	default:
		l.last[agg] = seq
		l.handled++
		l.progress <- l.handled
	}
	msg.Ack()
}

// MaxConcurrent is the most handler calls that were under way at once,
// across aggregates: 1 for a subscription that hands out one message at a
// time, up to the workers for one with many in flight.
func (l *OrderLedger) MaxConcurrent() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.maxRunning
}

// WaitHandled waits up to 3 minutes until l has handled n events, failing
// at the first order violation.
func (l *OrderLedger) WaitHandled(t testing.TB, n int) {
	t.Helper()
	timeout := time.After(3 * time.Minute)
	for {
		select {
		case h := <-l.progress:
			l.mu.Lock()
			violations := l.violations
			l.mu.Unlock()
			require.Empty(t, violations)
			if h >= n {
				return
			}
		case <-timeout:
			l.mu.Lock()
			defer l.mu.Unlock()
			require.FailNow(t, "not every event was handled", "%d of %d handled; violations %v", l.handled, n, l.violations)
		}
	}
}

// RequireComplete checks that every one of aggregates aggregates had per
// events take effect, once each and in order, and that some were nacked on
// purpose when nacks were asked for. It returns the duplicates delivered
// and the nacks.
func (l *OrderLedger) RequireComplete(t testing.TB, aggregates, per int, nacks bool) (dups, nacked int) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	require.Empty(t, l.violations)
	for a := range aggregates {
		require.Equal(t, per, l.last[OrderedAggregate(a)])
	}
	require.Equal(t, aggregates*per, l.handled)
	if nacks {
		require.NotEmpty(t, l.nacked)
	}
	return l.dups, len(l.nacked)
}

// OrderedAggregate is the id of the a-th aggregate PublishOrdered publishes to.
func OrderedAggregate(a int) string { return fmt.Sprintf("agg-%02d", a) }

// PublishOrdered publishes per events to each of aggregates aggregates,
// interleaved, with metadata seq 1..per for each aggregate and idx, the
// event's place in the whole run.
func PublishOrdered(t testing.TB, b adapters.Broker, topic string, aggregates, per int) {
	t.Helper()
	var batch []adapters.Outgoing
	flush := func() {
		require.NoError(t, b.PublishBatch(context.Background(), batch))
		batch = batch[:0]
	}
	for seq := 1; seq <= per; seq++ {
		for a := range aggregates {
			m := event(OrderedAggregate(a), seq)
			m.Metadata.Set("seq", strconv.Itoa(seq))
			m.Metadata.Set("idx", strconv.Itoa((seq-1)*aggregates+a))
			batch = append(batch, adapters.Outgoing{Topic: topic, Msg: m})
			if len(batch) == 500 {
				flush()
			}
		}
	}
	if len(batch) > 0 {
		flush()
	}
}

// OrderedConsumer is one ordered handler process: a Dispatcher with
// workers and prefetch over one subscription of its Source, each message
// handled by an OrderLedger.
type OrderedConsumer struct {
	d    *consumer.Dispatcher
	done chan struct{}
	// Subs receives each subscriber the Dispatcher opens.
	Subs chan message.Subscriber
}

// StartOrdered starts an OrderedConsumer on topic.
func StartOrdered(t testing.TB, topic string, src consumer.Source, workers, prefetch int, l *OrderLedger, latency time.Duration, nackEvery int) *OrderedConsumer {
	t.Helper()
	c := &OrderedConsumer{done: make(chan struct{}), Subs: make(chan message.Subscriber, 1)}
	newSub := src.NewSubscriber
	src.NewSubscriber = func() (message.Subscriber, error) {
		s, err := newSub()
		if err == nil {
			c.Subs <- s
		}
		return s, err
	}
	c.d = consumer.NewDispatcher(src, consumer.DispatchConfig{Workers: workers, Prefetch: prefetch, Ordered: true, DrainTimeout: 30 * time.Second})
	require.Equal(t, 1, c.d.Subscriptions())
	msgs, err := c.d.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	go func() {
		defer close(c.done)
		var wg sync.WaitGroup
		for msg := range msgs {
			wg.Go(func() { l.Handle(msg, latency, nackEvery) })
		}
		wg.Wait()
	}()
	return c
}

// Stop closes the consumer and waits until its handlers have returned.
func (c *OrderedConsumer) Stop(t testing.TB) {
	t.Helper()
	require.NoError(t, c.d.Close())
	<-c.done
}

// OneInFlightRate is the rate, in events/s, of an ordered handler over
// newSource's subscriber, for comparison with a Concurrent one: it
// publishes per events to each of aggregates aggregates on a topic and group
// of its own, consumes them with workers, prefetch and latency as
// StartOrdered does, and checks that they took effect in order.
func OneInFlightRate(t *testing.T, b adapters.Broker, newSource func(group string) consumer.Source, aggregates, per, workers, prefetch int, latency time.Duration) float64 {
	t.Helper()
	topic, group := Name("ordered"), Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	PublishOrdered(t, b, topic, aggregates, per)
	l := NewOrderLedger()
	start := time.Now()
	c := StartOrdered(t, topic, newSource(group), workers, prefetch, l, latency, 0)
	l.WaitHandled(t, aggregates*per)
	rate := float64(aggregates*per) / time.Since(start).Seconds()
	c.Stop(t)
	l.RequireComplete(t, aggregates, per, false)
	return rate
}

// ManyInFlight is the load of the adapters' tests of ordered subscribers
// with many messages in flight: 64 aggregates of 50 events each, interleaved
// on one topic, handled by 16 workers with a prefetch of 64 and a 2 ms
// handler that nacks every 97th event once. Each test starts consumers on
// it (Start), injects its broker's faults once the Ledger has handled
// given counts (Fault), and calls Finish.
type ManyInFlight struct {
	Ledger                             *OrderLedger
	topic                              string
	aggregates, per, workers, prefetch int
	latency                            time.Duration
	nackEvery                          int
	start                              time.Time
	steady                             float64 // events/s before the first fault
}

// NewManyInFlight publishes the load to topic on b.
func NewManyInFlight(t *testing.T, b adapters.Broker, topic string) *ManyInFlight {
	t.Helper()
	m := &ManyInFlight{Ledger: NewOrderLedger(), topic: topic, aggregates: 64, per: 50, workers: 16, prefetch: 64, latency: 2 * time.Millisecond, nackEvery: 97}
	PublishOrdered(t, b, topic, m.aggregates, m.per)
	return m
}

// Events is how many events the load has.
func (m *ManyInFlight) Events() int { return m.aggregates * m.per }

// Prefetch is the in-flight count to give the ordered subscriber.
func (m *ManyInFlight) Prefetch() int { return m.prefetch }

// OrderedSubscriber returns what makes the load's ordered subscribers: b's
// Subscriber for group, Ordered, with Prefetch messages in flight.
func (m *ManyInFlight) OrderedSubscriber(b adapters.Broker, group string) func() (message.Subscriber, error) {
	return func() (message.Subscriber, error) {
		return b.Subscriber(adapters.SubscriberSpec{Group: group, Ordered: true, InFlight: m.prefetch})
	}
}

// Start starts an OrderedConsumer of the load over src; the first one
// starts the clock.
func (m *ManyInFlight) Start(t *testing.T, src consumer.Source) *OrderedConsumer {
	t.Helper()
	if m.start.IsZero() {
		m.start = time.Now()
	}
	return StartOrdered(t, m.topic, src, m.workers, m.prefetch, m.Ledger, m.latency, m.nackEvery)
}

// Fault waits until the Ledger has handled n events and records the rate
// so far, before the fault the test injects next; the first call's rate
// is the steady one Finish reports.
func (m *ManyInFlight) Fault(t *testing.T, n int) {
	t.Helper()
	m.Ledger.WaitHandled(t, n)
	if m.steady == 0 {
		m.steady = float64(n) / time.Since(m.start).Seconds()
	}
}

// Finish waits until every event was handled, stops running, checks that
// every aggregate's events took effect once each and in order, with nacks,
// and logs the rate next to that of the same load, 5 events per
// aggregate, over the one-in-flight subscriber stock gives for a group of
// its own (OneInFlightRate); faults says what the test did meanwhile.
func (m *ManyInFlight) Finish(t *testing.T, b adapters.Broker, faults string, stock func(group string) consumer.Source, running ...*OrderedConsumer) {
	t.Helper()
	m.Ledger.WaitHandled(t, m.Events())
	elapsed := time.Since(m.start)
	for _, c := range running {
		c.Stop(t)
	}
	dups, nacked := m.Ledger.RequireComplete(t, m.aggregates, m.per, true)
	manyRate := float64(m.Events()) / elapsed.Seconds()
	t.Logf("many in flight: %d events in %s (%.0f/s) with %d nacks, %s; %d duplicates", m.Events(), elapsed.Round(time.Millisecond), manyRate, nacked, faults, dups)
	oneRate := OneInFlightRate(t, b, stock, m.aggregates, 5, m.workers, m.prefetch, m.latency)
	t.Logf("one in flight: %.0f events/s; many in flight: %.0f events/s before the first fault (%.1fx), %.0f events/s faults included (%.1fx)",
		oneRate, m.steady, m.steady/oneRate, manyRate, manyRate/oneRate)
}

// LostConnectionAndRestart is the run of an adapter whose ordered
// subscriber consumes over one connection: a consumer over newSubscriber
// (a competing, concurrent Source), loseConnection called with its
// subscriber once a third of the load was handled (messages in flight and
// held), a stop and a new consumer at two thirds, then Finish against
// stock.
func (m *ManyInFlight) LostConnectionAndRestart(t *testing.T, b adapters.Broker, newSubscriber func() (message.Subscriber, error), loseConnection func(message.Subscriber), stock func(group string) consumer.Source) {
	t.Helper()
	src := consumer.Source{NewSubscriber: newSubscriber, Competing: true, Concurrent: true}
	c := m.Start(t, src)
	sub := <-c.Subs
	m.Fault(t, m.Events()/3)
	loseConnection(sub)
	m.Fault(t, 2*m.Events()/3)
	c.Stop(t)
	c = m.Start(t, src)
	m.Finish(t, b, "a lost connection and a restart", stock, c)
}

// ConcurrentFlight checks b's unordered subscriptions that hand out many
// messages at once (Capabilities.ConcurrentFlight), with and, when b
// schedules redeliveries, without a RedeliveryWait of 100ms, each in a
// parallel subtest: one subscription with an InFlight of 8 hands out 8
// messages before any is settled and no 9th until one is; it takes their
// acks in any order; a nacked message comes again; every message is handed
// out; with a RedeliveryWait each message's delivery number is recorded
// while it is handed out (1, then 2 for the nacked one), and forgotten once
// it is settled. timeout bounds each wait (a nacked message comes back
// after the broker's redelivery delay).
func ConcurrentFlight(t *testing.T, b adapters.Broker, timeout time.Duration) {
	caps := b.Capabilities()
	require.True(t, caps.ConcurrentFlight, "%T has no Capabilities.ConcurrentFlight", b)
	t.Run("InFlight", func(t *testing.T) {
		t.Parallel()
		concurrentFlight(t, b, adapters.SubscriberSpec{}, timeout)
	})
	if !caps.ScheduledRedelivery {
		return
	}
	t.Run("InFlightRedeliveryWait", func(t *testing.T) {
		t.Parallel()
		concurrentFlight(t, b, adapters.SubscriberSpec{
			RedeliveryWait: func(int) time.Duration { return 100 * time.Millisecond },
			Deliveries:     &adapters.Deliveries{},
		}, timeout)
	})
}

func concurrentFlight(t *testing.T, b adapters.Broker, spec adapters.SubscriberSpec, timeout time.Duration) {
	ctx := context.Background()
	topic, group := Name("concurrent"), Name("g")
	require.NoError(t, b.Provision(ctx, topic, group))
	const inFlight, total = 8, 24
	msgs := make([]*message.Message, total)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("agg-%d", i), 1)
	}
	publishBatch(t, b, topic, msgs)

	spec.Group, spec.InFlight = group, inFlight
	sub, err := b.Subscriber(spec)
	require.NoError(t, err)
	numbered := func(m *message.Message, want int) {
		if spec.Deliveries == nil {
			return
		}
		n, ok := spec.Deliveries.Number(m)
		require.True(t, ok, "message %s has a delivery number", m.UUID)
		require.Equal(t, want, n, "delivery number of message %s", m.UUID)
	}
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	var first []*message.Message
	for range inFlight {
		first = append(first, Next(t, ch, timeout))
		numbered(first[len(first)-1], 1)
	}
	select {
	case m := <-ch:
		require.FailNow(t, "a message beyond inFlight was handed out before one was settled", "uuid %s", m.UUID)
	case <-time.After(500 * time.Millisecond):
	}
	nacked := first[0].UUID
	first[0].Nack()
	acked := map[string]int{}
	for i := len(first) - 1; i >= 1; i-- { // newest first: out of order
		first[i].Ack()
		acked[first[i].UUID]++
	}
	for len(acked) < total { // the nacked one included, once it came again
		m := Next(t, ch, timeout)
		if m.UUID == nacked {
			numbered(m, 2)
		} else {
			numbered(m, 1)
		}
		acked[m.UUID]++
		m.Ack()
	}
	if spec.Deliveries != nil {
		require.Eventually(t, func() bool {
			_, held := spec.Deliveries.Number(first[1])
			return !held
		}, timeout, 10*time.Millisecond, "a settled message's delivery number is forgotten")
	}
	require.Contains(t, acked, nacked, "the nacked message came again")
	for _, m := range msgs {
		require.Contains(t, acked, m.UUID, "never handed out")
	}
	require.Len(t, acked, total, "only the published messages")
	require.NoError(t, sub.Close())
}
