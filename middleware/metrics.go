package middleware

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/internal/promreg"
)

// Metric names, as they appear on /metrics.
const (
	MetricMessages        = "millrace_consumer_messages_total"
	MetricHandlerDuration = "millrace_consumer_handler_duration_seconds"
	MetricBreakerState    = "millrace_consumer_breaker_state"
	MetricAbandoned       = "millrace_consumer_abandoned_attempts_total"
	MetricAbandonedActive = "millrace_consumer_abandoned_attempts_running"
	MetricBatchSize       = "millrace_consumer_batch_size"
	MetricInboxRows       = "millrace_inbox_rows"
	MetricInboxPruned     = "millrace_inbox_pruned_total"
)

// Breaker states as the millrace_consumer_breaker_state gauge reports them.
const (
	BreakerClosed   = 0
	BreakerHalfOpen = 1
	BreakerOpen     = 2
)

// metrics are the collectors of one Stack. With no Registerer they still
// exist (unregistered), so the chain never checks for nil.
type metrics struct {
	messages  *prometheus.CounterVec
	duration  *prometheus.HistogramVec
	breaker   *prometheus.GaugeVec
	abandoned *prometheus.CounterVec
	running   *prometheus.GaugeVec
	batchSize *prometheus.HistogramVec
	inboxRows *prometheus.GaugeVec
	pruned    prometheus.Counter
	parked    *prometheus.GaugeVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		messages: counterVec(MetricMessages,
			"Consumed messages by handler and outcome: ok, duplicate, stale, poisoned, nacked; retried counts failed attempts that were retried.",
			"handler", "consumer_group", "outcome"),
		duration: histogramVec(MetricHandlerDuration,
			"Duration of one attempt: inbox transaction and handler, commit included.",
			prometheus.ExponentialBuckets(0.001, 2, 15), // 1ms .. ~16s
			"handler"),
		breaker: gaugeVec(MetricBreakerState,
			"Circuit breaker state per handler: 0 closed, 1 half-open, 2 open.",
			"handler"),
		abandoned: counterVec(MetricAbandoned,
			"Attempts abandoned because the handler did not return within handler_timeout; each counts as a failed attempt.",
			"handler"),
		running: gaugeVec(MetricAbandonedActive,
			"Abandoned attempts whose goroutine has not returned yet (a handler stuck regardless of its context).",
			"handler"),
		batchSize: histogramVec(MetricBatchSize,
			"Messages per batched inbox transaction (consumer.batch), one observation per transaction.",
			prometheus.ExponentialBuckets(1, 2, 9), // 1 .. 256
			"handler"),
		inboxRows: gaugeVec(MetricInboxRows,
			"Rows in the inbox table per consumer group, as of the last retention run.",
			"consumer_group"),
		pruned: prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricInboxPruned,
			Help: "Inbox rows deleted by the retention runner.",
		}),
		parked: gaugeVec(MetricParkedAggregates,
			"Order keys (aggregates) an ordered handler's consumer group holds parked behind a poisoned message, held or draining (consumer.poison.park).",
			"handler"),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	m.messages = register(reg, m.messages, &err)
	m.duration = register(reg, m.duration, &err)
	m.breaker = register(reg, m.breaker, &err)
	m.abandoned = register(reg, m.abandoned, &err)
	m.running = register(reg, m.running, &err)
	m.batchSize = register(reg, m.batchSize, &err)
	m.inboxRows = register(reg, m.inboxRows, &err)
	m.pruned = register(reg, m.pruned, &err)
	m.parked = register(reg, m.parked, &err)
	return m, err
}

// counterVec, gaugeVec and histogramVec make the Stack's collectors of
// one kind with the given labels.
func counterVec(name, help string, labels ...string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
}

func gaugeVec(name, help string, labels ...string) *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels)
}

func histogramVec(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, labels)
}

// register registers c, or returns the identical collector already
// registered (two Stacks on one registry share their metrics).
func register[C prometheus.Collector](reg prometheus.Registerer, c C, errp *error) C {
	c, err := promreg.Register(reg, c)
	if err != nil {
		*errp = errors.Join(*errp, fmt.Errorf("register metric: %w", err))
	}
	return c
}
