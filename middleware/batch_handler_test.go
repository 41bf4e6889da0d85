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
