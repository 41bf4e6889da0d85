package bus_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testlog"
)

// On NATS and RabbitMQ, and on Kafka with broker.kafka.retry_topics, an
// unordered handler's failing message waits for its next attempt at the
// broker (JetStream NakWithDelay; RabbitMQ the group's retry queue with a
// per-message expiration; Kafka the group's retry topic), not in a worker:
// with one worker, other messages are handled during its backoff. Its
// attempt number is the broker's (the JetStream delivery count; the delivery
// header of RabbitMQ's retry queue or Kafka's retry topic), so a consumer
// restart between attempts does not start it over, and it is poisoned on its
// max_attempts-th failed delivery.
func TestRetryFreesTheWorkerAndSurvivesARestart(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testRetryFreesTheWorker)
}

// retryRig is one broker's handler with one worker and a failing
// message among good ones, published straight to the broker.
type retryRig struct {
	kindRig
	cfg                    bus.Config
	topic, group, suffix   string
	broker                 adapters.Broker
	mu                     sync.Mutex
	badAttempts, goodsDone int
	goodsBetween           []int // goods handled before each attempt of the bad message after the first
}

const retryMaxAttempts, retryGoods = 3, 10

func testRetryFreesTheWorker(t *testing.T, kind string) {
	r := newRetryRig(t, kind)
	r.publish()
	// First consumer: attempts 1 and 2, then it stops while the message
	// waits at the broker.
	r.consumeUntil(func() bool { return r.badAttempts == 2 && r.parked() }, "the bad message's second attempt, handed to the broker")
	// Second consumer: attempt 3 is the last, and poisons the message.
	var attempts int
	r.consumeUntil(func() bool {
		err := r.db.QueryRowContext(context.Background(), `SELECT attempts FROM "`+r.cfg.Database.Schema+`".millrace_poison WHERE event_id = 'bad'`).Scan(&attempts)
		return err == nil
	}, "the bad message poisoned")

	r.mu.Lock()
	defer r.mu.Unlock()
	require.Equal(t, retryMaxAttempts, attempts, "poisoned at max_attempts exactly")
	require.Equal(t, retryMaxAttempts, r.badAttempts, "the restart did not start its attempts over")
	require.Equal(t, retryGoods, r.goodsDone)
	require.Positive(t, r.goodsBetween[0], "the only worker handled other messages during the first backoff")
	t.Logf("goods handled before attempts 2 and 3: %v of %d", r.goodsBetween, retryGoods)
}

// newRetryRig migrates a schema for a service without a relay, one
// worker and a 2s backoff, and opens its broker.
func newRetryRig(t *testing.T, kind string) *retryRig {
	ctx := context.Background()
	s := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Broker.Kafka.RetryTopics = true
		cfg.Relay.Enabled = new(bool)
		cfg.Consumer.Workers = 1
		cfg.Consumer.Retry.MaxAttempts = retryMaxAttempts
		cfg.Consumer.Retry.InitialInterval = 2 * time.Second
		cfg.Consumer.Retry.MaxInterval = 2 * time.Second
	})
	r := &retryRig{kindRig: kindRig{t, kind, s.DB}, cfg: s.Config, suffix: "_" + testkit.Suffix()}
	r.topic, r.group = "orders-"+r.suffix, "billing-"+r.suffix
	brokertest.Cleanup(t, kind, r.topic, r.group)
	broker, err := bus.OpenBroker(ctx, r.cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { broker.Close() })
	r.broker = broker
	return r
}

// publish puts the bad message and the goods on the broker.
func (r *retryRig) publish() {
	ctx := context.Background()
	require.NoError(r.t, r.broker.Provision(ctx, r.topic, r.group))
	require.NoError(r.t, r.broker.Publisher().Publish(r.topic, delivered(ctx, "bad", orderCreated("o-bad"))))
	for i := range retryGoods {
		require.NoError(r.t, r.broker.Publisher().Publish(r.topic, delivered(ctx, fmt.Sprint("good-", i), orderCreated(fmt.Sprint("o-", i)))))
	}
}

// handle counts the goods and fails the bad message, noting how many
// goods were handled before each of its later attempts.
func (r *retryRig) handle(_ context.Context, ev bus.Event) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ev.ID != "bad" {
		r.goodsDone++
		return nil
	}
	r.badAttempts++
	if r.badAttempts > 1 {
		r.goodsBetween = append(r.goodsBetween, r.goodsDone)
	}
	return errors.New("downstream refused the order")
}

// consumeUntil runs a consumer until it holds (under r.mu), and stops it.
func (r *retryRig) consumeUntil(until func() bool, what string) {
	t := r.t
	b, err := bus.Open(context.Background(), r.cfg, r.db)
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, b.Handle(r.topic, r.group, r.handle))
	running := testkit.Start(t, b.Run)
	testkit.Eventually(t, time.Minute, what, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return until()
	})
	require.NoError(t, running.Stop(t, time.Minute))
}

// parked says whether the bad message waits at the broker. On Kafka a
// failure the stop interrupts before it is parked is not counted (the
// record is read again with its number), and neither is one whose copy
// the stop interrupts after it reached the retry topic but before the
// group committed past the record it copied (the record is read again,
// and parked again). So the stop waits until the retry topic holds the
// copy for delivery 3 and the group has consumed all but that copy.
func (r *retryRig) parked() bool {
	if r.kind != bus.KindKafka {
		return true
	}
	retryTopic := kafka.RetryTopicName(r.topic, r.group)
	// A group that never read the retry topic is behind by all of it.
	return r.retryBacklog(retryTopic, "nobody-"+r.suffix) == 2 && r.retryBacklog(retryTopic, r.group) == 1
}

// retryBacklog is how far group is behind on topic, over its partitions.
func (r *retryRig) retryBacklog(topic, group string) int64 {
	backlog, err := r.broker.Backlog(context.Background(), topic, group)
	require.NoError(r.t, err)
	var n int64
	for _, p := range backlog {
		n += p
	}
	return n
}

// Failed attempts on every broker (in process on Kafka, scheduled by the
// broker on NATS and RabbitMQ): a typed handler and a typed batch handler
// read each attempt's number in Message.Attempt; each failed attempt is one
// log line at info, each poisoned message one line at warn with its reason,
// nothing of it at error, and every line's attributes come in key order.
func TestAttemptsAndTheirLogLines(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testAttemptsAndTheirLogLines)
}

func testAttemptsAndTheirLogLines(t *testing.T, kind string) {
	const maxAttempts = 3
	ctx := context.Background()
	svc := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Consumer.Retry.MaxAttempts = maxAttempts
		cfg.Consumer.Retry.InitialInterval = 10 * time.Millisecond
		cfg.Consumer.Retry.MaxInterval = 20 * time.Millisecond
		cfg.Consumer.Breaker.Enabled = new(false)
	})
	db, cfg := svc.DB, svc.Config
	suffix := "_" + testkit.Suffix()
	name, handler, batch := "orders-"+suffix, "billing-"+suffix, "ledger-"+suffix
	brokertest.Cleanup(t, kind, name, handler, batch)
	var logs testlog.Buffer
	b := svc.Open(t, bus.WithLogger(slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: watermill.LevelTrace}))))

	flaky, doomed, bad := "flaky-"+suffix, "doomed-"+suffix, "bad-"+suffix
	var mu sync.Mutex
	attempts := map[string][]int{} // handler + " " + event id -> Message.Attempt of each call
	record := func(h string, m bus.Message[placedV2]) int {
		mu.Lock()
		defer mu.Unlock()
		attempts[h+" "+m.ID] = append(attempts[h+" "+m.ID], m.Attempt)
		return m.Attempt
	}
	orders := bus.Must(bus.NewTopic[placedV2](name))
	require.NoError(t, orders.Handle(b, handler, func(ctx context.Context, m bus.Message[placedV2]) error {
		attempt := record(handler, m)
		switch {
		case m.ID == doomed, m.ID == flaky && attempt < maxAttempts:
			return errors.New("the payment service timed out")
		case m.ID == bad:
			return bus.Permanent(errors.New("the order total is negative"))
		}
		return nil
	}))
	require.NoError(t, orders.HandleBatch(b, batch, func(ctx context.Context, ms []bus.Message[placedV2]) error {
		failures := bus.BatchFailures{}
		for _, m := range ms {
			if record(batch, m) < maxAttempts && m.ID == flaky {
				failures[m.ID] = errors.New("the ledger is busy")
			}
		}
		return failures
	}))

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	for _, id := range []string{flaky, doomed, bad} {
		ev, err := orders.Event(placedV2{OrderID: id, TotalCents: 4200})
		require.NoError(t, err)
		ev.ID = id
		require.NoError(t, b.PublishInOwnTx(ctx, name, ev))
	}
	testkit.Eventually(t, 2*time.Minute, "flaky handled by both handlers and two events poisoned", func() bool {
		var poisoned int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".millrace_poison`).Scan(&poisoned))
		mu.Lock()
		defer mu.Unlock()
		return poisoned == 2 && len(attempts[handler+" "+flaky]) == maxAttempts && len(attempts[batch+" "+flaky]) == maxAttempts
	})
	stop()
	require.NoError(t, <-done)

	mu.Lock()
	require.Equal(t, map[string][]int{
		handler + " " + flaky: {1, 2, 3}, handler + " " + doomed: {1, 2, 3}, handler + " " + bad: {1},
		batch + " " + flaky: {1, 2, 3}, batch + " " + doomed: {1}, batch + " " + bad: {1},
	}, attempts)
	mu.Unlock()

	requireAttemptLines(t, logLines(t, logs.String()), flaky, doomed, bad)
}

// requireAttemptLines checks the log lines of the flow above: one line per
// failed attempt of flaky (in each of its two handlers) and doomed, a
// warning for each poisoned message with its reason, no error, and
// attributes in one order.
func requireAttemptLines(t *testing.T, lines []logLine, flaky, doomed, bad string) {
	t.Helper()
	about := func(id string) (out []logLine) {
		for _, l := range lines {
			if l.level != "DEBUG" && l.level != "DEBUG-4" && l.has(id) {
				out = append(out, l)
			}
		}
		return out
	}
	requireLines(t, about(flaky), "INFO", "INFO", "INFO", "INFO") // two failed attempts in each handler
	requireLines(t, about(doomed), "INFO", "INFO", "WARN")
	requireLines(t, about(bad), "WARN")
	for id, reason := range map[string]string{doomed: "3 attempts failed, last: the payment service timed out", bad: "the order total is negative"} {
		poisoned := about(id)[len(about(id))-1]
		require.Equal(t, "Message poisoned", poisoned.msg)
		require.Equal(t, reason, poisoned.attrs["reason"])
	}
	for _, l := range slices.Concat(about(flaky), about(doomed), about(bad)) {
		require.True(t, slices.IsSorted(l.keys), "attributes in key order: %s", l.raw)
	}
	// A logger's With attributes come first (in key order too): lines of
	// one kind have their attributes in one order.
	order := map[string]string{}
	for _, l := range lines {
		require.NotEqual(t, "ERROR", l.level, "nothing here is an error of the process: %s", l.raw)
		kind := l.msg + " " + strings.Join(slices.Sorted(slices.Values(l.keys)), ",")
		if first, seen := order[kind]; seen {
			require.Equal(t, first, strings.Join(l.keys, ","), "one order for %q", l.msg)
		}
		order[kind] = strings.Join(l.keys, ",")
	}
}

// logLine is one line of slog's JSON output.
type logLine struct {
	raw, level, msg string
	keys            []string // the attributes' keys in the order written, without time, level and msg
	attrs           map[string]any
}

func (l logLine) has(s string) bool { return strings.Contains(l.raw, s) }

// logLines parses slog's JSON lines, keeping the order of their keys.
func logLines(t *testing.T, out string) []logLine {
	t.Helper()
	var lines []logLine
	for _, raw := range strings.Split(strings.TrimSpace(out), "\n") {
		l := logLine{raw: raw, attrs: map[string]any{}}
		require.NoError(t, json.Unmarshal([]byte(raw), &l.attrs))
		l.level, _ = l.attrs["level"].(string)
		l.msg, _ = l.attrs["msg"].(string)
		dec := json.NewDecoder(bytes.NewReader([]byte(raw)))
		_, err := dec.Token() // {
		require.NoError(t, err)
		for dec.More() {
			key, err := dec.Token()
			require.NoError(t, err)
			var skip json.RawMessage
			require.NoError(t, dec.Decode(&skip))
			if k := key.(string); k != "time" && k != "level" && k != "msg" {
				l.keys = append(l.keys, k)
			}
		}
		_, err = dec.Token() // }
		require.True(t, err == nil || errors.Is(err, io.EOF))
		lines = append(lines, l)
	}
	return lines
}

// requireLines checks the levels of lines, in order.
func requireLines(t *testing.T, lines []logLine, levels ...string) {
	t.Helper()
	got := make([]string, len(lines))
	raws := make([]string, len(lines))
	for i, l := range lines {
		got[i], raws[i] = l.level, l.raw
	}
	require.Equal(t, levels, got, "%s", strings.Join(raws, "\n"))
}
