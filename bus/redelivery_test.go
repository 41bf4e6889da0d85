package bus_test

import (
	"context"
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
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			testRetryFreesTheWorker(t, kind)
		})
	}
}

func testRetryFreesTheWorker(t *testing.T, kind string) {
	const maxAttempts, goods = 3, 10
	ctx := context.Background()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, kind, &cfg)
	cfg.Broker.Kafka.RetryTopics = true
	cfg.Relay.Enabled = new(bool)
	cfg.Consumer.Workers = 1
	cfg.Consumer.Retry.MaxAttempts = maxAttempts
	cfg.Consumer.Retry.InitialInterval = 2 * time.Second
	cfg.Consumer.Retry.MaxInterval = 2 * time.Second
	suffix := testdb.UniqueName("")[2:]
	topic, group := "orders-"+suffix, "billing-"+suffix
	brokertest.Cleanup(t, kind, topic, group)
	require.NoError(t, bus.Migrate(ctx, db, cfg))

	var mu sync.Mutex
	badAttempts, goodsDone := 0, 0
	var goodsBetween []int // goods handled before each attempt of the bad message after the first
	handler := func(ctx context.Context, ev bus.Event) error {
		mu.Lock()
		defer mu.Unlock()
		if ev.ID != "bad" {
			goodsDone++
			return nil
		}
		badAttempts++
		if badAttempts > 1 {
			goodsBetween = append(goodsBetween, goodsDone)
		}
		return errors.New("downstream refused the order")
	}
	run := func(until func() bool, what string) {
		b, err := bus.Open(ctx, cfg, db)
		require.NoError(t, err)
		defer b.Close()
		require.NoError(t, b.Handle(topic, group, handler))
		runCtx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- b.Run(runCtx) }()
		testkit.Eventually(t, time.Minute, what, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return until()
		})
		stop()
		require.NoError(t, <-done)
	}

	broker, err := bus.OpenBroker(ctx, cfg, nil)
	require.NoError(t, err)
	defer broker.Close()
	require.NoError(t, broker.Provision(ctx, topic, group))
	require.NoError(t, broker.Publisher().Publish(topic, delivered(ctx, "bad", orderCreated("o-bad"))))
	for i := range goods {
		require.NoError(t, broker.Publisher().Publish(topic, delivered(ctx, fmt.Sprint("good-", i), orderCreated(fmt.Sprint("o-", i)))))
	}

	// First consumer: attempts 1 and 2, then it stops while the message
	// waits at the broker. On Kafka a failure the stop interrupts before it
	// is parked is not counted (the record is read again with its number),
	// so the stop waits until the retry topic holds the copy for delivery 3.
	parked := func() bool {
		if kind != bus.KindKafka {
			return true
		}
		// A group that never read the retry topic is behind by all of it.
		backlog, err := broker.(adapters.BacklogReporter).Backlog(ctx, kafka.RetryTopicName(topic, group), "nobody-"+suffix)
		require.NoError(t, err)
		var copies int64
		for _, n := range backlog {
			copies += n
		}
		return copies == 2
	}
	run(func() bool { return badAttempts == 2 && parked() }, "the bad message's second attempt, handed to the broker")
	// Second consumer: attempt 3 is the last, and poisons the message.
	var attempts int
	run(func() bool {
		err := db.QueryRowContext(ctx, `SELECT attempts FROM "`+cfg.Database.Schema+`".millrace_poison WHERE event_id = 'bad'`).Scan(&attempts)
		return err == nil
	}, "the bad message poisoned")

	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, maxAttempts, attempts, "poisoned at max_attempts exactly")
	require.Equal(t, maxAttempts, badAttempts, "the restart did not start its attempts over")
	require.Equal(t, goods, goodsDone)
	require.Positive(t, goodsBetween[0], "the only worker handled other messages during the first backoff")
	t.Logf("goods handled before attempts 2 and 3: %v of %d", goodsBetween, goods)
}
