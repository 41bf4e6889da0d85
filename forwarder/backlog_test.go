package forwarder_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/ops"
)

// gauges reads the relay's backlog gauges and forwarded counter from reg.
func gauges(t *testing.T, reg *prometheus.Registry) (pending, oldestAge, forwarded float64) {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range families {
		for _, m := range mf.GetMetric() {
			switch mf.GetName() {
			case "millrace_relay_pending_rows":
				pending = m.GetGauge().GetValue()
			case "millrace_relay_oldest_pending_age_seconds":
				oldestAge = m.GetGauge().GetValue()
			case "millrace_relay_messages_forwarded_total":
				forwarded = m.GetCounter().GetValue()
			}
		}
	}
	return pending, oldestAge, forwarded
}

// With the broker stopped and rows pending no batch succeeds, yet the
// pending and oldest-age gauges rise to what `millrace outbox status` says,
// and go back to 0 once the broker is back and the rows are forwarded.
func TestBacklogGaugesRiseWhileTheBrokerIsDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	srv := servers.StartNATS(t)
	broker, err := nats.Open(ctx, nats.Config{URL: srv.URL}, adapters.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { broker.Close() })
	status := func() ops.OutboxStatus { return outboxStatus(t, tb) }

	reg := prometheus.NewRegistry()
	cfg := testConfig()
	cfg.BacklogInterval = 100 * time.Millisecond
	start(t, tb, broker, cfg, reg)
	publish(t, tb, "things", []bus.Event{event("a", 1)}, 1)
	testkit.Eventually(t, waitLimit, "the first event forwarded", func() bool {
		_, _, forwarded := gauges(t, reg)
		return forwarded == 1 && status().Pending == 0
	})

	srv.Stop()
	publish(t, tb, "things", interleaved(3, 2), 2)
	require.EqualValues(t, 6, status().Pending)
	testkit.Eventually(t, waitLimit, "the gauges to show the rows pending during the outage", func() bool {
		pending, age, _ := gauges(t, reg)
		return pending == 6 && age > 0
	})
	pending, age, forwarded := gauges(t, reg)
	st := status()
	require.EqualValues(t, st.Pending, pending, "the gauge and outbox status agree")
	require.LessOrEqual(t, age, st.OldestPendingAge.Seconds(), "the gauge's age was measured no later than the status")
	require.Equal(t, 1.0, forwarded, "no batch succeeded while the broker was down")

	srv.Start()
	testkit.Eventually(t, waitLimit, "the gauges back to 0 after recovery", func() bool {
		pending, age, forwarded := gauges(t, reg)
		return pending == 0 && age == 0 && forwarded == 7
	})
	require.Zero(t, status().Pending)
}

// The next batch is read while a full one is published, after the position
// that batch would ack. When the broker confirms only a prefix, that read is
// from the wrong place: it is dropped and the batch after the prefix is read
// again, so nothing is skipped and the order holds.
func TestReadAheadIsDroppedWhenTheBatchBeforeItIsPartial(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	broker := newMemoryBroker()
	// Once each, the 10th and the 35th event fail, retryably.
	broker.fail = failOnce("10", "35")
	publish(t, tb, "things", sequence("a", 100), 100)
	cfg := testConfig()
	cfg.BatchSize, cfg.MaxInFlight = 20, 20 // full batches: each one reads the next ahead
	f, _ := start(t, tb, broker, cfg, nil)
	testkit.Eventually(t, waitLimit, "nothing pending", func() bool { return pending(t, f) == 0 })

	// The last delivery of each version, in delivery order, is 1..100: every
	// event arrived, and the re-sent ones came back in order.
	last := map[int]int{}
	got := broker.snapshot()
	for i, o := range got {
		v, err := strconv.Atoi(o.Msg.Metadata.Get(bus.AggregateVersionKey))
		require.NoError(t, err)
		last[v] = i
	}
	require.Len(t, last, 100)
	for v := 2; v <= 100; v++ {
		require.Less(t, last[v-1], last[v], "version %d after %d", v, v-1)
	}
	// Sent twice: 11..20 (after 10 failed in the batch 1..20) and 36..49
	// (after 35 failed in the batch 30..49).
	require.Len(t, got, 100+10+14)
}
