package bus_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/brokertest"
	"github.com/millrace-io/millrace/internal/testdb"
)

// Run exports each handler's backlog: on Kafka, N events the handler has
// not finished are a backlog of N (nothing is committed while they are in
// flight), and 0 once they are processed and committed.
func TestRunExportsTheBacklog(t *testing.T) {
	t.Parallel()
	const events = 12
	ctx := context.Background()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, bus.KindKafka, &cfg)
	cfg.Relay.Enabled = new(bool)
	cfg.Metrics.BacklogInterval = 50 * time.Millisecond
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
	brokertest.Cleanup(t, bus.KindKafka, topic, group)

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	defer func() { stop(); <-done }()
	for i := range events {
		id := fmt.Sprintf("e-%d", i)
		require.NoError(t, broker.Publisher().Publish(topic, delivered(ctx, id, orderCreated(fmt.Sprintf("o-%d", i)))))
	}
	backlog := func() float64 {
		families, err := reg.Gather()
		require.NoError(t, err)
		var sum float64
		for _, f := range families {
			if f.GetName() == bus.MetricConsumerBacklog {
				for _, m := range f.GetMetric() {
					sum += m.GetGauge().GetValue()
				}
			}
		}
		return sum
	}
	waitFor := func(want float64) {
		deadline := time.Now().Add(time.Minute)
		for backlog() != want {
			require.True(t, time.Now().Before(deadline), "backlog %v, want %v", backlog(), want)
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitFor(events)
	close(release)
	waitFor(0)
}
