package middleware_test

import (
	"errors"
	"fmt"
	"sync"
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
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []txCall
	for _, c := range l.calls {
		if c.eventID == eventID {
			out = append(out, c)
		}
	}
	return out
}

func (l *txLog) inTx(txid int64) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, c := range l.calls {
		if c.txid == txid {
			out = append(out, c.eventID)
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
