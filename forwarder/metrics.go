package forwarder

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Error classes of the publish_errors metric.
const (
	errorClassRetryable = "retryable"
	errorClassPermanent = "permanent"
	errorClassCorrupt   = "corrupt"
)

// metrics are the relay's Prometheus collectors.
type metrics struct {
	leader          prometheus.Gauge
	pending         prometheus.Gauge
	oldestAge       prometheus.Gauge
	batches         prometheus.Counter
	forwarded       prometheus.Counter
	publishErrors   *prometheus.CounterVec
	quarantined     prometheus.Counter
	deleted         prometheus.Counter
	commitToPublish prometheus.Histogram
	scheduledMoved  prometheus.Counter
	shardOwned      *prometheus.GaugeVec
	unowned         prometheus.Gauge
	shardPending    *prometheus.GaugeVec
	shardOldestAge  *prometheus.GaugeVec
	blocked         prometheus.Gauge
	blockers        *prometheus.GaugeVec
}

func newMetrics(reg prometheus.Registerer, outbox string, shards int) (*metrics, error) {
	labels := prometheus.Labels{"outbox": outbox}
	m := &metrics{
		leader: gauge(labels, "millrace_relay_active",
			"1 while this relay holds the outbox's lease (or a shard's) and forwards; 0 while it is a standby."),
		pending: gauge(labels, "millrace_relay_pending_rows",
			"Committed outbox rows not yet forwarded, as last measured by the active relay (every relay.backlog_interval, also while batches fail)."),
		oldestAge: gauge(labels, "millrace_relay_oldest_pending_age_seconds",
			"Age of the oldest committed outbox row not yet forwarded, as last measured by the active relay."),
		batches: counter(labels, "millrace_relay_batches_total",
			"Batches read, published and acked."),
		forwarded: counter(labels, "millrace_relay_messages_forwarded_total",
			"Messages the broker confirmed and the relay acked."),
		publishErrors: counterVec(labels, "millrace_relay_publish_errors_total",
			"Messages not published, by class: retryable (retried), permanent (quarantined), corrupt (envelope unreadable, quarantined).",
			[]string{"class"}),
		quarantined: counter(labels, "millrace_relay_quarantined_total",
			"Outbox rows moved to the relay quarantine table."),
		deleted: counter(labels, "millrace_relay_cleanup_deleted_total",
			"Forwarded outbox rows deleted by retention cleanup."),
		commitToPublish: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "millrace_relay_commit_to_publish_seconds", ConstLabels: labels,
			Help:    "From the event's occurred-at to the broker's confirm.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}),
		scheduledMoved: counter(labels, "millrace_relay_scheduled_moved_total",
			"Scheduled messages this relay moved into the outbox at their due time."),
		shardOwned: gaugeVec(labels, "millrace_relay_shard_owned",
			"1 for each shard this relay holds the lease of and forwards, 0 for the others (with relay.shards: 1, shard 0 is the outbox's lease).",
			[]string{"shard"}),
		unowned: gauge(labels, "millrace_relay_unowned_shards",
			"Shards whose lease no relay holds, as last measured by this relay (every relay.backlog_interval and before it takes shards; with relay.shards > 1)."),
		shardPending: gaugeVec(labels, "millrace_relay_shard_pending_rows",
			"Committed rows of a shard not yet forwarded, as last measured by the shard's owner (with relay.shards > 1).",
			[]string{"shard"}),
		shardOldestAge: gaugeVec(labels, "millrace_relay_shard_oldest_pending_age_seconds",
			"Age of a shard's oldest committed row not yet forwarded, as last measured by the shard's owner (with relay.shards > 1).",
			[]string{"shard"}),
		blocked: gauge(labels, "millrace_relay_blocked_seconds",
			"How long a statement of this relay has waited for a lock another transaction holds (a row lock on its cursor, a migration's lock on the outbox), past 1s; 0 when none waits. Measured every relay.backlog_interval."),
		blockers: gaugeVec(labels, "millrace_relay_blocker_age_seconds",
			"For each session whose transaction a statement of this relay waits for (past 1s): how long that transaction has been open, with its pid, application_name and state.",
			[]string{"pid", "application_name", "state"}),
	}
	for i := range shards {
		m.shardOwned.WithLabelValues(strconv.Itoa(i))
	}
	// Known label values start at zero, so rate() and alerts see the series
	// before the first error.
	for _, class := range []string{errorClassRetryable, errorClassPermanent, errorClassCorrupt} {
		m.publishErrors.WithLabelValues(class)
	}
	if reg == nil {
		return m, nil
	}
	if err := m.register(reg); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers every collector of m with reg.
func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.leader, m.pending, m.oldestAge, m.batches, m.forwarded,
		m.publishErrors, m.quarantined, m.deleted, m.commitToPublish, m.scheduledMoved, m.shardOwned, m.unowned, m.shardPending, m.shardOldestAge,
		m.blocked, m.blockers} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// gauge is a relay gauge named name, with the outbox's labels.
func gauge(labels prometheus.Labels, name, help string) prometheus.Gauge {
	return prometheus.NewGauge(prometheus.GaugeOpts{Name: name, ConstLabels: labels, Help: help})
}

// counter is a relay counter named name, with the outbox's labels.
func counter(labels prometheus.Labels, name, help string) prometheus.Counter {
	return prometheus.NewCounter(prometheus.CounterOpts{Name: name, ConstLabels: labels, Help: help})
}

// gaugeVec is a relay gauge vector named name, with the outbox's labels.
func gaugeVec(labels prometheus.Labels, name, help string, vars []string) *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, ConstLabels: labels, Help: help}, vars)
}

// counterVec is a relay counter vector named name, with the outbox's labels.
func counterVec(labels prometheus.Labels, name, help string, vars []string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, ConstLabels: labels, Help: help}, vars)
}
