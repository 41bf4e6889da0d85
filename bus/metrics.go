package bus

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/millrace-io/millrace/internal/promreg"
)

// Names of the metrics bus registers itself (the chain's are middleware's).
const (
	// MetricConsumerLag is the histogram of consumer lag: from an event's
	// occurred-at to the end of its processing (the handler's transaction
	// committed, before the ack), per handler.
	MetricConsumerLag = "millrace_consumer_lag_seconds"
	// MetricConsumerBacklog is the gauge of the messages a handler's
	// consumer group has not consumed yet, per partition (empty on brokers
	// without partitions), as the broker tells it every
	// metrics.backlog_interval.
	MetricConsumerBacklog = "millrace_consumer_backlog"
	// MetricUnknownTypes counts events typed handlers had no route for.
	MetricUnknownTypes = "millrace_consumer_unknown_types_total"
	// MetricSagaUnmatched counts saga events that matched no running
	// instance.
	MetricSagaUnmatched = "millrace_saga_unmatched_total"
)

// newBacklogMetric registers the consumer backlog gauge on reg.
func newBacklogMetric(reg prometheus.Registerer) (*prometheus.GaugeVec, error) {
	backlog := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: MetricConsumerBacklog,
		Help: "Messages of the topic the handler's consumer group has not consumed yet, per partition, as the broker reports it.",
	}, []string{"handler", "consumer_group", "partition"})
	if err := reg.Register(backlog); err != nil {
		return nil, fmt.Errorf("millrace: register %s: %w", MetricConsumerBacklog, err)
	}
	return backlog, nil
}

// newLagMetric registers the consumer lag histogram on reg.
func newLagMetric(reg prometheus.Registerer) (*prometheus.HistogramVec, error) {
	lag := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    MetricConsumerLag,
		Help:    "From an event's occurred-at to the end of its processing by the handler (committed, not yet acked).",
		Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600},
	}, []string{"handler", "consumer_group"})
	if err := reg.Register(lag); err != nil {
		return nil, fmt.Errorf("millrace: register %s: %w", MetricConsumerLag, err)
	}
	return lag, nil
}

// sharedCounter returns the counter *slot holds, registering the one opts
// and labels describe on the Bus's registry first when it holds none (or
// sharing the one another Bus registered there).
func (b *Bus) sharedCounter(slot **prometheus.CounterVec, opts prometheus.CounterOpts, labels ...string) (*prometheus.CounterVec, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if *slot == nil {
		c, err := promreg.Register(b.registerer, prometheus.NewCounterVec(opts, labels))
		if err != nil {
			return nil, fmt.Errorf("millrace: register %s: %w", opts.Name, err)
		}
		*slot = c
	}
	return *slot, nil
}

// MetricsHandler serves the Bus's metrics (relay, consumers, circuit
// breakers, inbox) in the Prometheus text format, for a service to mount on
// its own HTTP server.
func (b *Bus) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(b.gatherer, promhttp.HandlerOpts{})
}

// serveMetrics serves /metrics and the health endpoints on metrics.listen
// until ctx ends.
func (b *Bus) serveMetrics(ctx context.Context) (func(), error) {
	ln, err := net.Listen("tcp", b.cfg.Metrics.Listen)
	if err != nil {
		return nil, fmt.Errorf("millrace: metrics.listen %s: %w", b.cfg.Metrics.Listen, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", b.MetricsHandler())
	health := b.HealthHandler()
	for _, p := range []string{"/livez", "/readyz", "/healthz"} {
		mux.Handle(p, health)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			b.logger.Error("Metrics server stopped", err, nil)
		}
	}()
	return func() {
		shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
		<-done
	}, nil
}
