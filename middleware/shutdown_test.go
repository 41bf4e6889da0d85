package middleware_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

// Stopping the consumer is not a failure: a message waiting for its next
// retry is nacked, never poisoned, and comes back to the next consumer; an
// attempt already running finishes and commits before Close returns, and is
// acked before the subscriptions close.
func TestShutdownNacksWaitingMessagesAndDrainsRunningOnes(t *testing.T) {
	t.Parallel()
	testkit.Each(t, []string{bus.KindKafka, bus.KindNATS, bus.KindRabbitMQ}, func(t *testing.T, name string) {
		e, k, topic, group := newBilling(t, name, kitOptions{ackWait: 2 * time.Second})

		slowStarted := make(chan struct{})
		var failures atomic.Int64
		first := func(msg *message.Message) error {
			switch msg.Metadata.Get(bus.EventIDKey) {
			case "slow":
				close(slowStarted)
				time.Sleep(time.Second) // still running when the consumer stops
			case "failing":
				failures.Add(1)
				return errors.New("ledger unavailable")
			}
			return e.write(msg.Context(), group, msg)
		}
		cfg := middleware.Config{Workers: 2}
		cfg.Retry = middleware.RetryConfig{InitialInterval: time.Minute, MaxInterval: time.Minute, MaxElapsed: time.Hour}
		publish(t, k.pub, topic, event("slow", "o-1", 1, `{}`), event("failing", "o-2", 1, `{}`))
		c1 := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: first})
		<-slowStarted
		testkit.Eventually(t, 30*time.Second, "the failing message waits for its retry", func() bool {
			return c1.messages(t, "billing", middleware.OutcomeRetried) == 1
		})
		c1.close(t)

		require.Equal(t, 1, e.rows(t, "business", `event_id = 'slow'`),
			"the running attempt finished and committed")
		require.EqualValues(t, 1, c1.messages(t, "billing", middleware.OutcomeOK))
		require.EqualValues(t, 1, c1.messages(t, "billing", middleware.OutcomeNacked))
		require.Zero(t, c1.messages(t, "billing", middleware.OutcomePoisoned))
		require.EqualValues(t, 1, failures.Load(), "no retry ran after the stop")

		c2 := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group,
			handle: func(msg *message.Message) error { return e.write(msg.Context(), group, msg) }})
		testkit.Eventually(t, 30*time.Second, "the nacked message processed by the next consumer", func() bool {
			return c2.messages(t, "billing", middleware.OutcomeOK) == 1
		})
		// Had the slow message's ack been lost, it would come back within
		// the 2s ack wait; the inbox must absorb it.
		time.Sleep(3 * time.Second)
		t.Logf("duplicates after the restart: %v", c2.messages(t, "billing", middleware.OutcomeDuplicate))
		require.Equal(t, 2, e.rows(t, "business", ""), "one effect per event")
		require.Zero(t, e.rows(t, "millrace_poison", ""))
	})
}
