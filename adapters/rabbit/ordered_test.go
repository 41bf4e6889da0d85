package rabbit

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
	"github.com/millrace-io/millrace/adapters/adaptertest"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/middleware"
)

// orderLedger is an ordered handler's view of what it handled: per
// aggregate the last sequence number with an effect, as an inbox and an
// effect table would keep it. A delivery at or below it is a duplicate (the
// inbox drops it); one above the next is an order violation.
type orderLedger struct {
	mu         sync.Mutex
	last       map[string]int
	busy       map[string]bool
	nacked     map[string]bool // ids nacked once, on purpose
	handled    int             // deliveries with an effect
	dups       int
	violations []string
	progress   chan int // handled, after each effect
}

func newOrderLedger() *orderLedger {
	return &orderLedger{last: map[string]int{}, busy: map[string]bool{}, nacked: map[string]bool{}, progress: make(chan int, 1<<16)}
}

// handle is the handler: it sleeps latency (a database round trip), nacks
// the first delivery of every nackEvery-th event published (0: none), and acks the
// rest.
func (l *orderLedger) handle(msg *message.Message, latency time.Duration, nackEvery int) {
	agg := msg.Metadata.Get(envelope.AggregateIDKey)
	seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
	idx, _ := strconv.Atoi(msg.Metadata.Get("idx"))
	l.mu.Lock()
	if l.busy[agg] {
		l.violations = append(l.violations, fmt.Sprintf("%s: seq %d handed out while another was in flight", agg, seq))
	}
	l.busy[agg] = true
	l.mu.Unlock()
	time.Sleep(latency)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.busy[agg] = false
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

// publishOrdered publishes per events to each of aggregates aggregates,
// interleaved, with seq 1..per for each aggregate.
func publishOrdered(t *testing.T, b *Broker, topic string, aggregates, per int) {
	t.Helper()
	var batch []adapters.Outgoing
	flush := func() {
		require.NoError(t, b.PublishBatch(context.Background(), batch))
		batch = batch[:0]
	}
	for seq := 1; seq <= per; seq++ {
		for a := range aggregates {
			m := newMsg(fmt.Sprintf(`{"seq":%d}`, seq))
			m.Metadata.Set(envelope.AggregateIDKey, fmt.Sprintf("agg-%02d", a))
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

// orderedConsumer is one ordered handler process: a Dispatcher with
// workers and prefetch over one subscription of newSub.
type orderedConsumer struct {
	d    *middleware.Dispatcher
	done chan struct{}
	subs chan message.Subscriber
}

func startOrdered(t *testing.T, topic string, src middleware.Source, workers, prefetch int, l *orderLedger, latency time.Duration, nackEvery int) *orderedConsumer {
	t.Helper()
	c := &orderedConsumer{done: make(chan struct{}), subs: make(chan message.Subscriber, 1)}
	newSub := src.NewSubscriber
	src.NewSubscriber = func() (message.Subscriber, error) {
		s, err := newSub()
		if err == nil {
			c.subs <- s
		}
		return s, err
	}
	c.d = middleware.NewDispatcher(src, middleware.DispatchConfig{Workers: workers, Prefetch: prefetch, Ordered: true, DrainTimeout: 30 * time.Second})
	require.Equal(t, 1, c.d.Subscriptions())
	msgs, err := c.d.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	go func() {
		defer close(c.done)
		var wg sync.WaitGroup
		for msg := range msgs {
			wg.Go(func() { l.handle(msg, latency, nackEvery) })
		}
		wg.Wait()
	}()
	return c
}

func (c *orderedConsumer) stop(t *testing.T) {
	t.Helper()
	require.NoError(t, c.d.Close())
	<-c.done
}

// waitHandled waits until l has handled n events.
func waitHandled(t *testing.T, l *orderLedger, n int) {
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

// An ordered handler on one quorum queue with 16 workers and 64 aggregates
// has many messages in flight from its one OrderedSubscriber, and every
// aggregate's events take effect once each, in order, across nacks (whose
// messages and every later one of their aggregates come back before newer
// ones), a lost connection (its in-flight acks fail, so duplicates come
// back; the inbox would drop them) and a stop and start of the consumer
// with messages in flight and held. The quorum queue's return of unacked
// messages to its head, in delivery order, is what this relies on. The
// throughput against the one-in-flight stock subscriber is logged.
func TestOrderedSubscriberManyInFlight(t *testing.T) {
	t.Parallel()
	const (
		aggregates = 64
		per        = 50
		workers    = 16
		prefetch   = 64
		latency    = 2 * time.Millisecond
	)
	b := openBroker(t, testConfig(serverURL()))
	topic, group := adaptertest.Name("ordered"), adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	publishOrdered(t, b, topic, aggregates, per)
	n := aggregates * per

	l := newOrderLedger()
	src := middleware.Source{
		NewSubscriber: func() (message.Subscriber, error) { return b.OrderedSubscriber(group, prefetch) },
		Competing:     true,
		Concurrent:    true,
	}
	start := time.Now()
	c := startOrdered(t, topic, src, workers, prefetch, l, latency, 97)
	sub := (<-c.subs).(*subscriber)

	// A lost connection with messages in flight and held.
	waitHandled(t, l, n/3)
	sub.mu.Lock()
	require.NoError(t, sub.conn.Close())
	sub.mu.Unlock()

	// A stop of the consumer and a new one.
	waitHandled(t, l, 2*n/3)
	c.stop(t)
	c = startOrdered(t, topic, src, workers, prefetch, l, latency, 97)
	waitHandled(t, l, n)
	elapsed := time.Since(start)
	c.stop(t)

	l.mu.Lock()
	require.Empty(t, l.violations)
	for a := range aggregates {
		require.Equal(t, per, l.last[fmt.Sprintf("agg-%02d", a)])
	}
	require.Equal(t, n, l.handled)
	require.NotEmpty(t, l.nacked)
	manyRate := float64(n) / elapsed.Seconds()
	t.Logf("many in flight: %d events in %s (%.0f/s) with %d nacks, a lost connection and a restart; %d duplicates", n, elapsed.Round(time.Millisecond), manyRate, len(l.nacked), l.dups)
	l.mu.Unlock()

	// The stock subscriber: one message in flight, on another group.
	oneGroup := adaptertest.Name("g")
	oneTopicPer := 5
	oneTopic := adaptertest.Name("ordered")
	require.NoError(t, b.Provision(context.Background(), oneTopic, oneGroup))
	publishOrdered(t, b, oneTopic, aggregates, oneTopicPer)
	one := newOrderLedger()
	start = time.Now()
	c = startOrdered(t, oneTopic, middleware.Source{
		NewSubscriber: func() (message.Subscriber, error) { return b.Subscriber(oneGroup) },
		Competing:     true,
	}, workers, prefetch, one, latency, 0)
	waitHandled(t, one, aggregates*oneTopicPer)
	oneRate := float64(aggregates*oneTopicPer) / time.Since(start).Seconds()
	c.stop(t)
	require.Empty(t, one.violations)
	t.Logf("one in flight: %.0f events/s; many in flight (faults included): %.0f events/s, %.1fx", oneRate, manyRate, manyRate/oneRate)
}

// OrderedSubscriber refuses an in-flight count that is no AMQP prefetch.
func TestOrderedSubscriberInFlightRange(t *testing.T) {
	t.Parallel()
	b := openBroker(t, testConfig(serverURL()))
	for _, n := range []int{0, -1, 65536} {
		_, err := b.OrderedSubscriber("g", n)
		require.ErrorContains(t, err, "inFlight must be 1 to 65535")
		require.True(t, adapters.IsPermanent(err))
	}
}
