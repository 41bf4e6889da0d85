package middleware_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

// TestBrokerBacklog: every adapter reports a consumer group's backlog (what
// bus.Run exports as millrace_consumer_backlog): N events published and not
// consumed are a backlog of N, and once a consumer has processed them, 0.
func TestBrokerBacklog(t *testing.T) {
	t.Parallel()
	testkit.Each(t, batchBrokers, func(t *testing.T, broker string) {
		const events = 20
		e, k, topic, group := newBilling(t, broker, kitOptions{})
		reporter := k.broker
		require.True(t, reporter.Capabilities().Backlog, "%s reports backlogs", broker)
		backlog := func() int64 {
			parts, err := reporter.Backlog(context.Background(), topic, group)
			require.NoError(t, err)
			var sum int64
			for _, n := range parts {
				sum += n
			}
			return sum
		}
		require.Zero(t, backlog(), "nothing published yet")
		msgs := make([]*message.Message, events)
		for i := range msgs {
			msgs[i] = event(fmt.Sprintf("evt-%d", i), fmt.Sprintf("o-%d", i), 1, `{}`)
		}
		publish(t, k.pub, topic, msgs...)
		testkit.Eventually(t, time.Minute, "a backlog of every event published", func() bool { return backlog() == events })

		startConsumer(t, k, e, middleware.Config{}, handlerSpec{name: "billing", topic: topic, group: group,
			handle: func(msg *message.Message) error { return e.write(msg.Context(), group, msg) }})
		testkit.Eventually(t, time.Minute, "every event processed", func() bool {
			return e.rows(t, "business", "") == events
		})
		testkit.Eventually(t, time.Minute, "no backlog once processed (and, on Kafka, committed)", func() bool { return backlog() == 0 })
	})
}
