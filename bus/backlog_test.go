package bus_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// Run exports each handler's backlog and the age of the events it handled,
// on every broker. A handler that holds its first event, with one worker
// and one message in flight, leaves a backlog of N events: on Kafka all N
// (nothing is committed while the first is in flight), on NATS and
// RabbitMQ the N-1 the broker has not delivered yet (the NATS consumer has
// max_ack_pending 1, and consumer.prefetch 1 is the RabbitMQ channel's). Once the handler is released
// the backlog is 0, and the age histogram has one observation per event,
// each older than the time the events were held.
func TestRunExportsTheBacklog(t *testing.T) {
	t.Parallel()
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			const events = 12
			const held = 600 * time.Millisecond
			ctx := context.Background()
			db := testdb.Open(t)
			var cfg bus.Config
			cfg.Database.Schema = testdb.Schema(t, db)
			brokertest.Apply(t, kind, &cfg)
			cfg.Relay.Enabled = new(bool)
			cfg.Metrics.BacklogInterval = 50 * time.Millisecond
			cfg.Consumer.Workers = 1
			cfg.Consumer.Prefetch = 1
			cfg.Broker.NATS.Consumer.MaxAckPending = 1
			suffix := testdb.UniqueName("")[2:]
			topic, group := "orders-"+suffix, "billing-"+suffix
			require.NoError(t, bus.Migrate(ctx, db, cfg))
			reg := prometheus.NewRegistry()
			b, err := bus.Open(ctx, cfg, db, bus.WithRegistry(reg))
			require.NoError(t, err)
			defer b.Close()
			release := make(chan struct{})
			require.NoError(t, b.Handle(topic, group, func(ctx context.Context, ev bus.Event) error {
				<-release
				return nil
			}))
			broker, err := bus.OpenBroker(ctx, cfg, nil)
			require.NoError(t, err)
			defer broker.Close()
			require.NoError(t, broker.Provision(ctx, topic, group))
			brokertest.Cleanup(t, kind, topic, group)

			runCtx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- b.Run(runCtx) }()
			defer func() { stop(); <-done }()
			for i := range events {
				id := fmt.Sprintf("e-%d", i)
				msg := delivered(ctx, id, orderCreated(fmt.Sprintf("o-%d", i)))
				msg.Metadata.Set(bus.OccurredAtKey, time.Now().UTC().Format(time.RFC3339Nano))
				require.NoError(t, broker.Publisher().Publish(topic, msg))
			}
			gather := func() (backlog float64, ages *dto.Histogram) {
				families, err := reg.Gather()
				require.NoError(t, err)
				ages = &dto.Histogram{}
				for _, f := range families {
					for _, m := range f.GetMetric() {
						switch f.GetName() {
						case bus.MetricConsumerBacklog:
							backlog += m.GetGauge().GetValue()
						case bus.MetricConsumerLag:
							ages = m.GetHistogram()
						}
					}
				}
				return backlog, ages
			}
			backlog := func() float64 { n, _ := gather(); return n }
			want := float64(events - 1)
			if kind == bus.KindKafka {
				want = events
			}
			testkit.Eventually(t, time.Minute, fmt.Sprintf("a backlog of %v", want), func() bool { return backlog() == want })
			_, ages := gather()
			require.Zero(t, ages.GetSampleCount(), "no event handled yet")
			time.Sleep(held)
			close(release)
			testkit.Eventually(t, time.Minute, "no backlog once every event is processed", func() bool { return backlog() == 0 })
			testkit.Eventually(t, time.Minute, "an age observed for every event", func() bool {
				_, ages := gather()
				return ages.GetSampleCount() == events
			})
			_, ages = gather()
			for _, bucket := range ages.GetBucket() {
				if bucket.GetUpperBound() < held.Seconds() {
					require.Zero(t, bucket.GetCumulativeCount(), "every event was older than %s when handled; bucket le=%v", held, bucket.GetUpperBound())
				}
			}
			require.GreaterOrEqual(t, ages.GetSampleSum(), events*held.Seconds(), "the ages add up to at least the time each was held")
		})
	}
}
