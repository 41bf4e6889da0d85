package bus_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
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
			r := newBacklogRig(t, kind)
			r.publish()
			want := float64(backlogEvents - 1)
			if kind == bus.KindKafka {
				want = backlogEvents
			}
			testkit.Eventually(t, time.Minute, fmt.Sprintf("a backlog of %v", want), func() bool { return r.backlog() == want })
			_, ages := r.gather()
			require.Zero(t, ages.GetSampleCount(), "no event handled yet")
			time.Sleep(backlogHeld)
			close(r.release)
			r.checkDrainedAndAged()
		})
	}
}

// The events of a backlog test, and how long its handler holds the first.
const (
	backlogEvents = 12
	backlogHeld   = 600 * time.Millisecond
)

// backlogRig is a service whose one handler, with one worker and one
// message in flight, holds its first event until release is closed.
type backlogRig struct {
	t            *testing.T
	reg          *prometheus.Registry
	broker       adapters.Broker
	topic, group string
	release      chan struct{}
}

// newBacklogRig runs the holding handler on kind.
func newBacklogRig(t *testing.T, kind string) *backlogRig {
	ctx := context.Background()
	s := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Relay.Enabled = new(bool)
		cfg.Metrics.BacklogInterval = 50 * time.Millisecond
		cfg.Consumer.Workers = 1
		cfg.Consumer.Prefetch = 1
		cfg.Broker.NATS.Consumer.MaxAckPending = 1
	})
	suffix := testdb.UniqueName("")[2:]
	r := &backlogRig{t: t, reg: prometheus.NewRegistry(), topic: "orders-" + suffix, group: "billing-" + suffix, release: make(chan struct{})}
	b := s.Open(t, bus.WithRegistry(r.reg))
	require.NoError(t, b.Handle(r.topic, r.group, func(ctx context.Context, ev bus.Event) error {
		<-r.release
		return nil
	}))
	var err error
	r.broker, err = bus.OpenBroker(ctx, s.Config, nil)
	require.NoError(t, err)
	t.Cleanup(func() { r.broker.Close() })
	require.NoError(t, r.broker.Provision(ctx, r.topic, r.group))
	brokertest.Cleanup(t, kind, r.topic, r.group)
	running := testkit.Start(t, b.Run)
	t.Cleanup(func() { _ = running.Stop(t, time.Minute) })
	return r
}

// publish puts the events on the broker, each occurring now.
func (r *backlogRig) publish() {
	ctx := context.Background()
	for i := range backlogEvents {
		id := fmt.Sprintf("e-%d", i)
		msg := delivered(ctx, id, orderCreated(fmt.Sprintf("o-%d", i)))
		msg.Metadata.Set(bus.OccurredAtKey, time.Now().UTC().Format(time.RFC3339Nano))
		require.NoError(r.t, r.broker.Publisher().Publish(r.topic, msg))
	}
}

// gather reads the backlog gauge and the age histogram.
func (r *backlogRig) gather() (backlog float64, ages *dto.Histogram) {
	families, err := r.reg.Gather()
	require.NoError(r.t, err)
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

// backlog is the backlog gauge.
func (r *backlogRig) backlog() float64 { n, _ := r.gather(); return n }

// checkDrainedAndAged: once released, the backlog drains and every event
// has an age observed, each older than the time the events were held.
func (r *backlogRig) checkDrainedAndAged() {
	t := r.t
	testkit.Eventually(t, time.Minute, "no backlog once every event is processed", func() bool { return r.backlog() == 0 })
	testkit.Eventually(t, time.Minute, "an age observed for every event", func() bool {
		_, ages := r.gather()
		return ages.GetSampleCount() == backlogEvents
	})
	_, ages := r.gather()
	for _, bucket := range ages.GetBucket() {
		if bucket.GetUpperBound() < backlogHeld.Seconds() {
			require.Zero(t, bucket.GetCumulativeCount(), "every event was older than %s when handled; bucket le=%v", backlogHeld, bucket.GetUpperBound())
		}
	}
	require.GreaterOrEqual(t, ages.GetSampleSum(), backlogEvents*backlogHeld.Seconds(), "the ages add up to at least the time each was held")
}
