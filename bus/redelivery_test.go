package bus_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
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
	t                      *testing.T
	kind                   string
	db                     *sql.DB
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
	r := &retryRig{t: t, kind: kind, db: s.DB, cfg: s.Config, suffix: testdb.UniqueName("")[2:]}
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
