package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
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

// batchBrokers are the brokers the batching tests run on.
var batchBrokers = []string{bus.KindKafka, bus.KindNATS, bus.KindRabbitMQ}

// txLog records, per handler call, the event and the database transaction
// the call ran in, so that a test sees which messages shared a batch.
type txLog struct {
	mu    sync.Mutex
	calls []txCall
}

type txCall struct {
	eventID string
	txid    int64
}

// record notes the call of msg and returns the calls made before it. Its
// error, the transaction's (say, the batch's deadline passed on a loaded
// machine), is for the handler to return: the chain retries the message.
func (l *txLog) record(msg *message.Message) (txCall, []txCall, error) {
	ctx := msg.Context()
	var txid int64
	if err := middleware.Tx(ctx).QueryRowContext(ctx, `SELECT txid_current()`).Scan(&txid); err != nil {
		return txCall{}, nil, fmt.Errorf("read the transaction id: %w", err)
	}
	c := txCall{eventID: msg.Metadata.Get(bus.EventIDKey), txid: txid}
	l.mu.Lock()
	defer l.mu.Unlock()
	before := append([]txCall(nil), l.calls...)
	l.calls = append(l.calls, c)
	return c, before, nil
}

func (l *txLog) of(eventID string) []txCall {
	return l.where(func(c txCall) bool { return c.eventID == eventID })
}

func (l *txLog) inTx(txid int64) []string {
	var out []string
	for _, c := range l.where(func(c txCall) bool { return c.txid == txid }) {
		out = append(out, c.eventID)
	}
	return out
}

// where returns the calls keep accepts, in call order.
func (l *txLog) where(keep func(txCall) bool) []txCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []txCall
	for _, c := range l.calls {
		if keep(c) {
			out = append(out, c)
		}
	}
	return out
}

// TestBatchPoisonsOnlyTheBadMessage runs a backlog through batched inbox
// transactions. The first message whose batch already ran another message
// fails permanently, and the next message of that batch panics once: the
// first is poisoned alone, the panicking one is retried, and every other
// message of the batch commits once, in that batch's transaction.
func TestBatchPoisonsOnlyTheBadMessage(t *testing.T) {
	t.Parallel()
	testkit.Each(t, batchBrokers, func(t *testing.T, broker string) {
		testBatchPoisonsOnlyTheBadMessage(t, broker)
	})
}

func testBatchPoisonsOnlyTheBadMessage(t *testing.T, broker string) {
	const events = 8
	e, k, topic, group := newBilling(t, broker, kitOptions{maxAckPending: events})
	msgs := make([]*message.Message, events)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("evt-%d", i), fmt.Sprintf("o-%d", i), 1, `{"amount":1}`)
	}
	// The test needs a batch of more than one message: the events are
	// published together, and a batch closes at MaxMessages, so a long
	// MaxWait costs nothing when they arrive together and lets a batch
	// form on a loaded machine, where 500ms between two arrivals was seen.
	cfg := middleware.Config{Workers: events, Batch: middleware.BatchConfig{MaxMessages: events, MaxWait: 5 * time.Second}}
	fastRetry(&cfg, 3)
	p := &batchPoisoner{}
	c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: func(msg *message.Message) error {
		bad, err := p.pick(msg)
		if err != nil {
			return err
		}
		if err := e.write(msg.Context(), group, msg); err != nil {
			return err
		}
		if bad {
			return bus.Permanent(errors.New("this message can never be processed"))
		}
		return nil
	}})
	// Published once every subscription is open: a NATS push
	// consumer gives a backlog waiting at the start to the first
	// subscription, which holds one message at a time.
	publish(t, k.pub, topic, msgs...)

	testkit.Eventually(t, 2*time.Minute, "every message settled", func() bool {
		// An outcome is counted once its attempt has returned
		// through the chain, after the COMMIT that shows its rows.
		return e.rows(t, "millrace_inbox", "") == events-1 &&
			e.rows(t, "millrace_poison", "") == 1 &&
			c.messages(t, "billing", middleware.OutcomeOK)+c.messages(t, "billing", middleware.OutcomePoisoned) >= events
	})
	p.mu.Lock()
	defer p.mu.Unlock()
	poisoned := p.poisoned
	require.NotEmpty(t, poisoned, "some batch held more than one message")
	require.Equal(t, 1, e.rows(t, "millrace_poison", `event_id = $1`, poisoned))
	require.Zero(t, e.rows(t, "business", `event_id = $1`, poisoned),
		"the poisoned message's write was rolled back with its savepoint")
	require.Equal(t, events-1, e.rows(t, "business", ""), "one effect per other message")
	require.Equal(t, events-1, e.count(t, `SELECT count(DISTINCT event_id) FROM `+e.table("business")))
	p.checkBatchMates(t)
	require.Equal(t, 1.0, c.messages(t, "billing", middleware.OutcomePoisoned))
	require.Equal(t, float64(events-1), c.messages(t, "billing", middleware.OutcomeOK))
	require.Positive(t, c.metric(t, middleware.MetricBatchSize, map[string]string{"handler": "billing"}))
}

// batchPoisoner picks, among the handler's calls, the first message whose
// batch already ran another message (poisoned), and the next message of
// that batch, which panics once (panicked).
type batchPoisoner struct {
	log                txLog
	mu                 sync.Mutex
	poisoned, panicked string
	poisonTx           int64
}

// pick records msg's call and says whether msg is the poisoned one; it
// panics for the one picked to panic. Its error is the transaction's.
func (p *batchPoisoner) pick(msg *message.Message) (bool, error) {
	call, before, err := p.log.record(msg)
	if err != nil {
		return false, err
	}
	p.mu.Lock()
	shared := false
	for _, b := range before {
		shared = shared || b.txid == call.txid
	}
	switch {
	case p.poisoned == "" && shared:
		p.poisoned, p.poisonTx = call.eventID, call.txid
	case p.poisoned == call.eventID:
	case p.panicked == "" && p.poisoned != "" && call.txid == p.poisonTx:
		p.panicked = call.eventID
		p.mu.Unlock()
		panic("a handler bug hit once")
	}
	bad := p.poisoned == call.eventID
	p.mu.Unlock()
	return bad, nil
}

// checkBatchMates checks that the poisoned message's batch committed the
// others at their first call, and that the panicking one was retried once,
// in a later transaction. p.mu is held.
func (p *batchPoisoner) checkBatchMates(t *testing.T) {
	mates := p.log.inTx(p.poisonTx)
	t.Logf("the poisoned message %s shared its batch with %v; %q panicked once", p.poisoned, mates, p.panicked)
	var committedMates int
	for _, id := range mates {
		if id == p.poisoned || id == p.panicked {
			continue
		}
		committedMates++
		require.Len(t, p.log.of(id), 1, "%s, in the poisoned message's batch, committed there at its first call", id)
	}
	require.Positive(t, committedMates, "the poisoned message's batch committed the others: %v", mates)
	if p.panicked != "" {
		calls := p.log.of(p.panicked)
		require.Len(t, calls, 2, "the panicking message was retried once")
		require.NotEqual(t, p.poisonTx, calls[1].txid, "and committed in a later transaction")
	}
}

// TestBatchSlowTurnSendsTheRestToAnotherBatch: every handler call takes
// longer than a tenth of handler_timeout, so each batch's first turn sends
// the messages after it to another batch; each message still commits its
// effect once, and none is taken for a duplicate of itself (a batch that
// inserted the inbox rows of its messages first takes those of the ones it
// sent away out again).
func TestBatchSlowTurnSendsTheRestToAnotherBatch(t *testing.T) {
	t.Parallel()
	testkit.Each(t, []string{"gochannel", bus.KindKafka}, func(t *testing.T, broker string) {
		const events = 8
		e, k, topic, group := newBilling(t, broker, kitOptions{})
		msgs := make([]*message.Message, events)
		for i := range msgs {
			msgs[i] = event(fmt.Sprintf("evt-%d", i), fmt.Sprintf("o-%d", i), 1, `{"amount":1}`)
		}
		cfg := middleware.Config{Workers: events, HandlerTimeout: 2 * time.Second,
			Batch: middleware.BatchConfig{MaxMessages: events, MaxWait: time.Second}}
		var log txLog
		c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: func(msg *message.Message) error {
			if _, _, err := log.record(msg); err != nil {
				return err
			}
			time.Sleep(300 * time.Millisecond) // past handler_timeout/10
			return e.write(msg.Context(), group, msg)
		}})
		publish(t, k.pub, topic, msgs...)

		testkit.Eventually(t, 2*time.Minute, "every message settled", func() bool {
			return c.messages(t, "billing", middleware.OutcomeOK)+c.messages(t, "billing", middleware.OutcomeDuplicate) >= events
		})
		require.Equal(t, float64(events), c.messages(t, "billing", middleware.OutcomeOK), "none taken for a duplicate")
		require.Equal(t, events, e.rows(t, "business", ""), "one effect per message")
		require.Equal(t, events, e.count(t, `SELECT count(DISTINCT event_id) FROM `+e.table("business")))
		require.Greater(t, c.metric(t, middleware.MetricBatchSize, map[string]string{"handler": "billing"}), 1.0,
			"batches were sent away and formed again")
	})
}

// TestBatchTrickleRunsAfterMaxWait: a message arriving while the only other
// message in flight waits out a long retry backoff is committed alone once
// batch.max_wait has passed, without waiting for the batch to fill or for
// the other message to come back.
//
// Not on NATS: JetStream hands a queue subscriber a new message while it
// still holds one (max_ack_pending counts per consumer, not per
// subscriber), so there the trickle message can land on the subscription
// that holds the blocker and wait out its retry (seen in CI). On Kafka the
// two keys go to different partitions; RabbitMQ's prefetch of 1 gives the
// trickle message to a free subscription.
func TestBatchTrickleRunsAfterMaxWait(t *testing.T) {
	t.Parallel()
	testkit.Each(t, []string{bus.KindKafka, bus.KindRabbitMQ}, func(t *testing.T, broker string) {
		e, k, topic, group := newBilling(t, broker, kitOptions{})

		cfg := middleware.Config{Workers: 8, Batch: middleware.BatchConfig{MaxMessages: 8, MaxWait: 20 * time.Millisecond}}
		// The retry waits less than NATS's ack_wait (30s), which would
		// send the blocker again.
		cfg.Retry = middleware.RetryConfig{MaxAttempts: 3, InitialInterval: 20 * time.Second, MaxInterval: 20 * time.Second,
			MaxElapsed: 10 * time.Minute, Jitter: new(false)}
		var log txLog
		startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: func(msg *message.Message) error {
			call, _, err := log.record(msg)
			if err != nil {
				return err
			}
			if call.eventID == "blocker" {
				return errors.New("not yet") // retried after 20s
			}
			return e.write(msg.Context(), group, msg)
		}})

		publish(t, k.pub, topic, event("blocker", "o-1", 1, `{}`))
		testkit.Eventually(t, time.Minute, "the blocker failed once and waits for its retry", func() bool { return len(log.of("blocker")) == 1 })
		publish(t, k.pub, topic, event("trickle", "o-2", 1, `{}`))
		testkit.Eventually(t, time.Minute, "the trickle message committed", func() bool {
			return e.rows(t, "business", `event_id = 'trickle'`) == 1
		})
		require.Len(t, log.of("blocker"), 1, "the trickle message did not wait for the blocker's retry")
		calls := log.of("trickle")
		require.Len(t, calls, 1)
		require.Equal(t, []string{"trickle"}, log.inTx(calls[0].txid), "it ran in a batch of its own, not a full one")
	})
}

// TestBatchKeepsAggregateOrder: an ordered handler with batching on applies
// every aggregate's events in order, each once (on Kafka, where one
// subscription has a message of each partition in flight, so batches form).
func TestBatchKeepsAggregateOrder(t *testing.T) {
	t.Parallel()
	const aggregates, perAggregate = 8, 10
	e, k, topic, group := newBilling(t, bus.KindKafka, kitOptions{})
	var msgs []*message.Message
	for v := 1; v <= perAggregate; v++ {
		for a := range aggregates {
			msgs = append(msgs, event(fmt.Sprintf("evt-%d-%d", a, v), fmt.Sprintf("o-%d", a), int64(v), `{}`))
		}
	}
	publish(t, k.pub, topic, msgs...)
	cfg := middleware.Config{Workers: 8, Ordered: new(true), Batch: middleware.BatchConfig{MaxMessages: 8, MaxWait: 5 * time.Millisecond}}
	c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group,
		handle: func(msg *message.Message) error { return e.write(msg.Context(), group, msg) }})
	testkit.Eventually(t, time.Minute, "every event applied", func() bool {
		return e.rows(t, "business", "") == len(msgs)
	})
	require.Zero(t, e.count(t, `SELECT count(*) FROM (SELECT version < lag(version) OVER (PARTITION BY aggregate_id ORDER BY seq) AS back FROM `+
		e.table("business")+`) s WHERE back`), "no aggregate's version went back")
	require.Equal(t, len(msgs), e.count(t, `SELECT count(DISTINCT event_id) FROM `+e.table("business")))
	require.Positive(t, c.metric(t, middleware.MetricBatchSize, map[string]string{"handler": "billing"}))
}

// TestBatchOffOnASingleOrderedSubscription: an ordered handler on RabbitMQ
// has one subscription, so one message in flight; with batching on, each
// message still gets a transaction of its own at once instead of a batch
// waiting for messages that cannot come.
func TestBatchOffOnASingleOrderedSubscription(t *testing.T) {
	t.Parallel()
	const events = 10
	e, k, topic, group := newBilling(t, bus.KindRabbitMQ, kitOptions{})
	cfg := middleware.Config{Workers: 8, Ordered: new(true), Batch: middleware.BatchConfig{MaxMessages: 8, MaxWait: time.Second}}
	c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group,
		handle: func(msg *message.Message) error { return e.write(msg.Context(), group, msg) }})
	msgs := make([]*message.Message, events)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("evt-%d", i), "o-1", int64(i+1), `{}`)
	}
	publish(t, k.pub, topic, msgs...)
	testkit.Eventually(t, time.Minute, "every event applied", func() bool {
		return e.rows(t, "business", "") == events
	})
	require.Zero(t, c.metric(t, middleware.MetricBatchSize, map[string]string{"handler": "billing"}), "no batched transaction")
	require.Zero(t, e.count(t, `SELECT count(*) FROM (SELECT version < lag(version) OVER (ORDER BY seq) AS back FROM `+
		e.table("business")+`) s WHERE back`), "in order")
}

// batchCalls records every call of a batch handler: the event ids it was
// given and the database transaction it ran in.
type batchCalls struct {
	mu    sync.Mutex
	calls []batchCallLog
}

type batchCallLog struct {
	ids  []string
	txid int64
}

// record notes a call; n is its index.
func (l *batchCalls) record(t testing.TB, ctx context.Context, msgs []*message.Message) (n int, ids []string) {
	var txid int64
	require.NoError(t, middleware.Tx(ctx).QueryRowContext(ctx, `SELECT txid_current()`).Scan(&txid))
	for _, m := range msgs {
		ids = append(ids, middleware.EventID(m))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, batchCallLog{ids: ids, txid: txid})
	return len(l.calls) - 1, ids
}

// given counts the calls that were given id.
func (l *batchCalls) given(id string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, c := range l.calls {
		if slices.Contains(c.ids, id) {
			n++
		}
	}
	return n
}

func (l *batchCalls) all() []batchCallLog {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.calls)
}

// batchHandlerRun is a batch handler consuming a topic of its own.
type batchHandlerRun struct {
	e            *env
	c            *testConsumer
	group, topic string
	calls        batchCalls
}

// startBatchHandler starts the batch handler "billing" on broker, with
// batches of up to events messages, then publishes msgs. The handler records
// each call and writes one business row per message; then its result is
// then's, given the call's index and event ids (nil when then is nil).
func startBatchHandler(t *testing.T, broker string, events int, cfg middleware.Config,
	then func(call int, ids []string) error, msgs ...*message.Message) *batchHandlerRun {
	r := &batchHandlerRun{}
	var k *kit
	r.e, k, r.topic, r.group = newBilling(t, broker, kitOptions{maxAckPending: len(msgs)})
	cfg.Workers = events
	cfg.Batch = middleware.BatchConfig{MaxMessages: events, MaxWait: 500 * time.Millisecond}
	var held atomic.Bool
	r.c = startConsumer(t, k, r.e, cfg, handlerSpec{name: "billing", topic: r.topic, group: r.group,
		batch: func(ctx context.Context, msgs []*message.Message) error {
			if held.CompareAndSwap(false, true) {
				// The first call takes its time, so that the messages
				// arriving meanwhile gather in the next batch.
				time.Sleep(300 * time.Millisecond)
			}
			n, ids := r.calls.record(t, ctx, msgs)
			if err := r.writeAll(ctx, msgs); err != nil || then == nil {
				return err
			}
			return then(n, ids)
		}})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("batch handler calls: %v; ok %v, retried %v, poisoned %v, nacked %v", r.calls.all(),
				r.c.messages(t, "billing", middleware.OutcomeOK), r.c.messages(t, "billing", middleware.OutcomeRetried),
				r.c.messages(t, "billing", middleware.OutcomePoisoned), r.c.messages(t, "billing", middleware.OutcomeNacked))
		}
	})
	// Published once every subscription is open (see TestBatchPoisonsOnlyTheBadMessage).
	publish(t, k.pub, r.topic, msgs...)
	return r
}

// writeAll is a batch handler's business write: one row per message.
func (r *batchHandlerRun) writeAll(ctx context.Context, msgs []*message.Message) error {
	for _, m := range msgs {
		if err := r.e.write(ctx, r.group, m); err != nil {
			return err
		}
	}
	return nil
}

// waitSettled waits until ok messages are acked and poisoned are poisoned.
func (r *batchHandlerRun) waitSettled(t testing.TB, ok, poisoned int) {
	t.Helper()
	testkit.Eventually(t, 2*time.Minute, "every message settled", func() bool {
		return r.c.messages(t, "billing", middleware.OutcomeOK) == float64(ok) &&
			r.c.messages(t, "billing", middleware.OutcomePoisoned) == float64(poisoned)
	})
}

// effects is the number of business rows of id.
func (r *batchHandlerRun) effects(t testing.TB, id string) int {
	return r.e.rows(t, "business", `event_id = $1`, id)
}

func batchEvents(n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("evt-%d", i), fmt.Sprintf("o-%d", i), 1, `{"amount":1}`)
	}
	return msgs
}

// firstBatch returns the first call given more than one message, failing
// the test when there was none.
func firstBatch(t testing.TB, calls []batchCallLog) batchCallLog {
	for _, c := range calls {
		if len(c.ids) > 1 {
			return c
		}
	}
	t.Fatalf("no batch held more than one message: %v", calls)
	return batchCallLog{}
}

// TestBatchHandlerNeverSeesDuplicates: every event is delivered twice (the
// second delivery a new broker message with the same event id, so that
// NATS's own deduplication lets it through); the batch handler is given
// each event once, in batches, and each has one effect.
func TestBatchHandlerNeverSeesDuplicates(t *testing.T) {
	t.Parallel()
	testkit.Each(t, batchBrokers, func(t *testing.T, broker string) {
		const events = 8
		var msgs []*message.Message
		for _, msg := range batchEvents(events) {
			dup := msg.Copy()
			dup.UUID = msg.UUID + "-again"
			msgs = append(msgs, msg, dup)
		}
		r := startBatchHandler(t, broker, events, middleware.Config{}, nil, msgs...)
		testkit.Eventually(t, 2*time.Minute, "every delivery acked", func() bool {
			return r.c.messages(t, "billing", middleware.OutcomeOK) == events &&
				r.c.messages(t, "billing", middleware.OutcomeDuplicate) >= events
		})
		for i := range events {
			id := fmt.Sprintf("evt-%d", i)
			require.Equal(t, 1, r.calls.given(id), "%s given to the handler once", id)
			require.Equal(t, 1, r.effects(t, id))
		}
		firstBatch(t, r.calls.all())
		require.Zero(t, r.e.rows(t, "millrace_poison", ""))
	})
}

// TestBatchHandlerFailsOneMessage: the batch handler fails one message of
// its first batch of several permanently and, when the batch holds more
// than two, another one transiently, once. The permanent one is poisoned alone, the transient one is
// retried alone and commits, and every other message of that batch commits
// once, in a later transaction, without them.
func TestBatchHandlerFailsOneMessage(t *testing.T) {
	t.Parallel()
	testkit.Each(t, batchBrokers, func(t *testing.T, broker string) {
		const events = 8
		var mu sync.Mutex
		var flaky, bad string
		failedCall := -1
		cfg := middleware.Config{}
		fastRetry(&cfg, 3)
		r := startBatchHandler(t, broker, events, cfg, func(n int, ids []string) error {
			mu.Lock()
			defer mu.Unlock()
			switch {
			case bad == "" && len(ids) > 1:
				bad, failedCall = ids[0], n
				failures := middleware.BatchFailures{bad: bus.Permanent(errors.New("this message can never be processed"))}
				if len(ids) > 2 {
					flaky = ids[len(ids)-1]
					failures[flaky] = errors.New("not yet")
				}
				return failures
			case slices.Contains(ids, bad):
				t.Errorf("the poisoned message %s was given again: %v", bad, ids)
			}
			return nil
		}, batchEvents(events)...)
		r.waitSettled(t, events-1, 1)
		mu.Lock()
		defer mu.Unlock()
		require.NotEmpty(t, bad, "some batch held more than one message")
		require.Equal(t, 1, r.e.rows(t, "millrace_poison", `event_id = $1`, bad))
		require.Zero(t, r.effects(t, bad), "the failed message's write was rolled back")
		require.Equal(t, events-1, r.e.rows(t, "business", ""))
		failed := r.calls.all()[failedCall]
		t.Logf("batch %v failed %s (permanently) and %s (once)", failed.ids, bad, flaky)
		for _, id := range failed.ids {
			if id == bad {
				continue
			}
			require.Equal(t, 1, r.effects(t, id), "%s committed once", id)
			require.Equal(t, 2, r.calls.given(id), "%s was handed over once more and committed", id)
		}
		wantRetried := 0
		if flaky != "" {
			wantRetried = 1
		}
		require.EqualValues(t, wantRetried, r.c.messages(t, "billing", middleware.OutcomeRetried), "only the transient failure was retried")
	})
}

// TestBatchHandlerFailsTheWholeBatch: an error other than BatchFailures
// fails every message of the batch; each is retried and commits once.
func TestBatchHandlerFailsTheWholeBatch(t *testing.T) {
	t.Parallel()
	testkit.Each(t, batchBrokers, func(t *testing.T, broker string) {
		const events = 8
		var failedOnce sync.Once
		failedSize := 0
		cfg := middleware.Config{}
		fastRetry(&cfg, 3)
		// The whole batch's failures would open the breaker, which
		// holds the retries instead of counting them.
		cfg.Breaker.Enabled = new(false)
		r := startBatchHandler(t, broker, events, cfg, func(_ int, ids []string) error {
			var fail error
			if len(ids) > 1 {
				failedOnce.Do(func() { failedSize, fail = len(ids), errors.New("the other service is down") })
			}
			return fail
		}, batchEvents(events)...)
		testkit.Eventually(t, 2*time.Minute, "every message committed", func() bool {
			return r.c.messages(t, "billing", middleware.OutcomeOK) == events
		})
		failed := firstBatch(t, r.calls.all())
		require.Len(t, failed.ids, failedSize)
		require.EqualValues(t, failedSize, r.c.messages(t, "billing", middleware.OutcomeRetried), "every message of the failed batch was retried")
		for _, id := range failed.ids {
			require.Equal(t, 1, r.effects(t, id), "%s committed once", id)
			require.GreaterOrEqual(t, r.calls.given(id), 2)
		}
		require.Equal(t, events, r.e.rows(t, "business", ""))
		require.Zero(t, r.e.rows(t, "millrace_poison", ""))
	})
}

// TestBatchHandlerResultForAnUnknownMessage: a batch handler that fails an
// event id it was not given is a bug: every message of the batch fails with
// an *UnknownBatchMessageError naming that id (here poisoned at once, with
// one attempt), and nothing of the batch commits.
func TestBatchHandlerResultForAnUnknownMessage(t *testing.T) {
	t.Parallel()
	testkit.Each(t, batchBrokers, func(t *testing.T, broker string) {
		const events = 4
		cfg := middleware.Config{}
		fastRetry(&cfg, 1)
		r := startBatchHandler(t, broker, events, cfg, func(int, []string) error {
			return middleware.BatchFailures{"evt-not-in-any-batch": errors.New("no such message")}
		}, batchEvents(events)...)
		testkit.Eventually(t, 2*time.Minute, "every message poisoned", func() bool {
			return r.c.messages(t, "billing", middleware.OutcomePoisoned) == events
		})
		require.Zero(t, r.e.rows(t, "business", ""), "nothing committed")
		require.Equal(t, events, r.e.rows(t, "millrace_poison",
			`reason LIKE '%batch handler returned a failure for event id "evt-not-in-any-batch"%'`))
	})
}

// TestBatchHandlerPanic: a panic rolls back the batch's effects, and every
// message of the batch is tried again in a batch of its own: the one that
// makes the handler panic is retried alone and poisoned at max_attempts, the
// others commit once.
func TestBatchHandlerPanic(t *testing.T) {
	t.Parallel()
	testkit.Each(t, batchBrokers, func(t *testing.T, broker string) {
		const events = 8
		var mu sync.Mutex
		var culprit string
		cfg := middleware.Config{}
		fastRetry(&cfg, 3)
		r := startBatchHandler(t, broker, events, cfg, func(_ int, ids []string) error {
			mu.Lock()
			if culprit == "" && len(ids) > 1 {
				culprit = ids[len(ids)/2]
			}
			hit := slices.Contains(ids, culprit)
			mu.Unlock()
			if hit {
				panic("a handler bug")
			}
			return nil
		}, batchEvents(events)...)
		r.waitSettled(t, events-1, 1)
		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, 1, r.e.rows(t, "millrace_poison", `event_id = $1 AND attempts = 3`, culprit))
		require.Zero(t, r.effects(t, culprit))
		require.Equal(t, events-1, r.e.rows(t, "business", ""))
		panicked := firstBatch(t, r.calls.all())
		require.Contains(t, panicked.ids, culprit)
		require.True(t, slices.ContainsFunc(r.calls.all(), func(c batchCallLog) bool { return slices.Equal(c.ids, []string{culprit}) }),
			"after the panic the culprit was tried alone")
		for _, id := range panicked.ids {
			if id != culprit {
				require.Equal(t, 1, r.effects(t, id), "%s committed once", id)
			}
		}
	})
}
