package consumer

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// aheadSubscriber delivers its messages in order without waiting for acks, as
// a prefetching broker adapter does (and unlike Watermill's stock ones). It is
// a fake for these unit tests of the Dispatcher's scheduling; the integration
// tests run the Dispatcher over real brokers.
type aheadSubscriber struct {
	msgs      []*message.Message
	sent      atomic.Int32 // messages taken by the Dispatcher
	closeOnce sync.Once
	closed    chan struct{}
}

func newAhead(msgs ...*message.Message) *aheadSubscriber {
	return &aheadSubscriber{msgs: msgs, closed: make(chan struct{})}
}

func (a *aheadSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	ch := make(chan *message.Message)
	go func() {
		defer close(ch)
		for _, m := range a.msgs {
			select {
			case ch <- m:
				a.sent.Add(1)
			case <-a.closed:
				return
			}
		}
		<-a.closed
	}()
	return ch, nil
}

func (a *aheadSubscriber) Close() error {
	a.closeOnce.Do(func() { close(a.closed) })
	return nil
}

func keyed(key string, n int) *message.Message {
	msg := message.NewMessage(fmt.Sprintf("%s-%03d", key, n), nil)
	msg.Metadata.Set("aggregate-id", key)
	return msg
}

// startAhead starts a Dispatcher with cfg over an aheadSubscriber of msgs,
// subscribed with ctx.
func startAhead(t *testing.T, ctx context.Context, cfg DispatchConfig, msgs ...*message.Message) (*aheadSubscriber, *Dispatcher, <-chan *message.Message) {
	t.Helper()
	sub := newAhead(msgs...)
	d := NewDispatcher(Source{NewSubscriber: func() (message.Subscriber, error) { return sub, nil }}, cfg)
	out, err := d.Subscribe(ctx, "t")
	require.NoError(t, err)
	return sub, d, out
}

// routeAll reads the Dispatcher's output as Watermill's router does, one
// goroutine per message, until handle has returned for n messages; then it
// closes d and waits for every goroutine.
func routeAll(t *testing.T, d *Dispatcher, out <-chan *message.Message, n int, handle func(*message.Message)) {
	t.Helper()
	var done, wg sync.WaitGroup
	done.Add(n)
	wg.Go(func() {
		for msg := range out {
			wg.Go(func() {
				defer done.Done()
				handle(msg)
			})
		}
	})
	done.Wait()
	require.NoError(t, d.Close())
	wg.Wait()
}

// gauge counts the handlers running at once and keeps the most there were.
type gauge struct{ now, peak atomic.Int32 }

// enter notes a handler starting and returns how many run now.
func (g *gauge) enter() int32 {
	n := g.now.Add(1)
	for m := g.peak.Load(); n > m && !g.peak.CompareAndSwap(m, n); m = g.peak.Load() {
	}
	return n
}

// leave notes a handler ending.
func (g *gauge) leave() { g.now.Add(-1) }

// keyLog checks that no two messages of one key run at once, and records
// the order each key's messages ran in and how many ran at once.
type keyLog struct {
	inFlight gauge
	mu       sync.Mutex
	busy     map[string]int
	seen     map[string][]string
}

func newKeyLog() *keyLog {
	return &keyLog{busy: map[string]int{}, seen: map[string][]string{}}
}

// start notes msg of key starting, and whether it is the key's first.
func (l *keyLog) start(t *testing.T, key string, msg *message.Message) (first bool) {
	l.inFlight.enter()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.busy[key]++
	require.Equal(t, 1, l.busy[key], "two messages of %s at once", key)
	first = len(l.seen[key]) == 0
	l.seen[key] = append(l.seen[key], msg.UUID)
	return first
}

// end notes a message of key ending.
func (l *keyLog) end(key string) {
	l.mu.Lock()
	l.busy[key]--
	l.mu.Unlock()
	l.inFlight.leave()
}

func TestDispatcherKeepsAggregateOrderAndRunsKeysConcurrently(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent()) // what runs already is not this test's (the process's Kafka dev cluster on a later -count)
	const keys, perKey, workers = 4, 25, 4
	var msgs []*message.Message
	for i := range perKey {
		for k := range keys {
			msgs = append(msgs, keyed(fmt.Sprintf("k%d", k), i))
		}
	}
	_, d, out := startAhead(t, context.Background(), DispatchConfig{Workers: workers, Prefetch: 64, Ordered: true}, msgs...)
	require.Equal(t, 1, d.Subscriptions())

	log := newKeyLog()
	allFour := make(chan struct{})
	var firstWave sync.WaitGroup
	firstWave.Add(workers)
	go func() { firstWave.Wait(); close(allFour) }()
	routeAll(t, d, out, len(msgs), func(msg *message.Message) {
		key := msg.Metadata.Get("aggregate-id")
		if log.start(t, key, msg) {
			// The first message of every key waits until all four run at
			// once: the Dispatcher must release other keys meanwhile.
			firstWave.Done()
			select {
			case <-allFour:
			case <-time.After(10 * time.Second):
				t.Error("the first messages of the four keys never ran at the same time")
			}
		}
		log.end(key)
		msg.Ack()
	})

	require.Equal(t, int32(workers), log.inFlight.peak.Load())
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		require.Len(t, log.seen[key], perKey)
		for i, id := range log.seen[key] {
			require.Equal(t, fmt.Sprintf("%s-%03d", key, i), id, "order of %s", key)
		}
	}
}

func TestDispatcherUnorderedUsesEveryWorker(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent()) // what runs already is not this test's (the process's Kafka dev cluster on a later -count)
	const workers = 3
	var msgs []*message.Message
	for i := range 30 {
		msgs = append(msgs, keyed("same", i))
	}
	_, d, out := startAhead(t, context.Background(), DispatchConfig{Workers: workers}, msgs...)
	var inFlight gauge
	barrier := make(chan struct{})
	var once sync.Once
	routeAll(t, d, out, len(msgs), func(msg *message.Message) {
		n := inFlight.enter()
		require.LessOrEqual(t, n, int32(workers))
		if n == workers {
			once.Do(func() { close(barrier) })
		}
		select {
		case <-barrier:
		case <-time.After(10 * time.Second):
			t.Error("three messages of one key never ran at once without ordering")
		}
		inFlight.leave()
		msg.Ack()
	})
	require.Equal(t, int32(workers), inFlight.peak.Load())
}

func TestDispatcherNacksTheTailOfANackedKey(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent()) // what runs already is not this test's (the process's Kafka dev cluster on a later -count)
	a1, a2, a3, b1 := keyed("a", 1), keyed("a", 2), keyed("a", 3), keyed("b", 1)
	sub, d, out := startAhead(t, context.Background(), DispatchConfig{Workers: 1, Prefetch: 8, Ordered: true}, a1, a2, a3, b1)

	first := <-out
	require.Equal(t, a1.UUID, first.UUID)
	// Once b1 is taken, a2 and a3 (taken before it) wait behind a1.
	require.Eventually(t, func() bool { return sub.sent.Load() == 4 }, 5*time.Second, time.Millisecond)
	first.Nack()
	next := <-out
	require.Equal(t, b1.UUID, next.UUID, "a2 and a3 must wait for a1's redelivery, b1 need not")
	next.Ack()
	for _, m := range []*message.Message{a2, a3} {
		select {
		case <-m.Nacked():
		case <-time.After(5 * time.Second):
			t.Fatalf("%s was not nacked", m.UUID)
		}
	}
	require.NoError(t, d.Close())
	_, open := <-out
	require.False(t, open, "the output is closed after Close")
}

func TestDispatcherCloseNacksHeldMessages(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent()) // what runs already is not this test's (the process's Kafka dev cluster on a later -count)
	var msgs []*message.Message
	for i := range 6 {
		msgs = append(msgs, keyed("a", i))
	}
	ctx, cancel := context.WithCancel(context.Background())
	_, d, out := startAhead(t, ctx, DispatchConfig{Workers: 2, Prefetch: 6, Ordered: true}, msgs...)
	inHand := <-out
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		cancel() // the router's context ends: the Dispatcher stops
		require.NoError(t, d.Close())
	}()
	select {
	case <-inHand.Context().Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the message in flight did not see the stop")
	}
	inHand.Ack() // the drain waits for this
	<-stopped
	for _, m := range msgs[1:] {
		select {
		case <-m.Nacked():
		case <-m.Acked():
			t.Fatalf("%s acked", m.UUID)
		default:
			// Not taken from the subscription at all: also fine, nothing acked it.
		}
	}
	_, open := <-out
	require.False(t, open)
	require.NoError(t, d.Close(), "Close is idempotent")
}

func TestDispatcherSubscriptionCount(t *testing.T) {
	t.Parallel()
	newSub := func() (message.Subscriber, error) { return nil, nil }
	cases := []struct {
		src     Source
		ordered bool
		want    int
	}{
		{Source{NewSubscriber: newSub, Competing: true}, false, 8},
		{Source{NewSubscriber: newSub, Competing: true}, true, 1},
		{Source{NewSubscriber: newSub, Competing: true, KeyPartitioned: true}, false, 1},
		{Source{NewSubscriber: newSub}, false, 1},
	}
	for _, tc := range cases {
		require.Equal(t, tc.want, NewDispatcher(tc.src, DispatchConfig{Workers: 8, Ordered: tc.ordered}).Subscriptions(), "%+v", tc)
	}
}

// With DispatchConfig.Key an ordered Dispatcher keeps the order of that key
// (a saga's correlation id) across aggregates, and runs other keys
// concurrently.
func TestDispatcherOrdersByItsKey(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent()) // what runs already is not this test's (the process's Kafka dev cluster on a later -count)
	var msgs []*message.Message
	for i := range 20 {
		msg := keyed(fmt.Sprintf("agg-%d", i), i) // every message its own aggregate
		msg.Metadata.Set("correlation", fmt.Sprintf("c%d", i%2))
		msgs = append(msgs, msg)
	}
	byCorrelation := func(m *message.Message) string { return m.Metadata.Get("correlation") }
	_, d, out := startAhead(t, context.Background(), DispatchConfig{Workers: 4, Prefetch: 20, Ordered: true, Key: byCorrelation}, msgs...)
	log := newKeyLog()
	routeAll(t, d, out, len(msgs), func(msg *message.Message) {
		key := msg.Metadata.Get("correlation")
		log.start(t, key, msg)
		time.Sleep(2 * time.Millisecond)
		log.end(key)
		msg.Ack()
	})
	require.Equal(t, int32(2), log.inFlight.peak.Load(), "one message per key, both keys at once")
	for k := range 2 {
		var want []string
		for i := k; i < 20; i += 2 {
			want = append(want, fmt.Sprintf("agg-%d-%03d", i, i))
		}
		require.Equal(t, want, log.seen[fmt.Sprintf("c%d", k)], "c%d in delivery order", k)
	}
}

// A released message that pauses its worker slot (a message waiting for its
// next attempt) lets the next message run on its worker, and takes a worker
// again, before any new message, once one is free.
func TestDispatcherGivesAPausedWorkerToTheNextMessage(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent()) // what runs already is not this test's (the process's Kafka dev cluster on a later -count)
	msgs := []*message.Message{keyed("a", 0), keyed("b", 0), keyed("c", 0)}
	_, d, out := startAhead(t, context.Background(), DispatchConfig{Workers: 1, Prefetch: 3}, msgs...)
	var mu sync.Mutex
	var order []string
	note := func(s string) {
		mu.Lock()
		order = append(order, s)
		mu.Unlock()
	}
	bDone := make(chan struct{})
	routeAll(t, d, out, len(msgs), func(msg *message.Message) {
		id := msg.Metadata.Get("aggregate-id")
		note("start " + id)
		if id == "a" {
			slot := d.lease(msg).Worker
			require.NotNil(t, slot)
			slot.Pause()
			select {
			case <-bDone:
			case <-time.After(10 * time.Second):
				t.Error("b never ran while a was paused")
			}
			require.NoError(t, slot.Resume(msg.Context()))
			note("resumed a")
		}
		if id == "b" {
			close(bDone)
			time.Sleep(50 * time.Millisecond) // a asks for its worker back meanwhile
		}
		note("end " + id)
		msg.Ack()
	})
	require.Equal(t, []string{"start a", "start b", "end b", "resumed a", "end a", "start c", "end c"}, order,
		"b ran on a's worker while a was paused; a took the worker back before c")
}
