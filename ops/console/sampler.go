package console

import (
	"context"
	"log/slog"
	"maps"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/ops"
)

// sampleWindow is how long the console keeps its samples: the overview's
// charts show the last hour.
const sampleWindow = time.Hour

// maxSamples bounds the samples kept per series, whatever the interval.
const maxSamples = 3600

// sample is one measurement of a series.
type sample struct {
	At time.Time
	V  float64
}

// ring holds the latest samples of one series, at most cap(buf) of them.
type ring struct {
	buf  []sample
	next int // the oldest sample, once buf is full
}

func (r *ring) add(s sample) {
	if len(r.buf) < cap(r.buf) {
		r.buf = append(r.buf, s)
		return
	}
	r.buf[r.next] = s
	r.next = (r.next + 1) % len(r.buf)
}

// since returns a copy of the samples taken at from or later, oldest first.
func (r *ring) since(from time.Time) []sample {
	out := make([]sample, 0, len(r.buf))
	for i := range r.buf {
		if s := r.buf[(r.next+i)%len(r.buf)]; !s.At.Before(from) {
			out = append(out, s)
		}
	}
	return out
}

// newest is the time of the latest sample.
func (r *ring) newest() time.Time {
	return r.buf[(r.next+len(r.buf)-1)%len(r.buf)].At
}

// sampler measures, every interval, what the database keeps no history
// of: each relay group's oldest pending age (ops.Client.OutboxStatuses) and,
// given a registry, each consumer group's backlog (millrace_consumer_backlog
// summed over the group's handlers and partitions). It keeps the last hour
// of samples in memory, in one goroutine that close ends.
type sampler struct {
	ops     *ops.Client
	metrics prometheus.Gatherer
	every   time.Duration
	keep    int // samples per series
	log     *slog.Logger
	started time.Time

	mu      sync.Mutex
	oldest  map[string]*ring // per relay group, in seconds
	backlog map[string]*ring // per consumer group, in messages

	stop context.CancelFunc
	done chan struct{}
}

// startSampler starts sampling at once and then every interval.
func startSampler(oc *ops.Client, metrics prometheus.Gatherer, every time.Duration, log *slog.Logger) *sampler {
	ctx, stop := context.WithCancel(context.Background())
	s := &sampler{ops: oc, metrics: metrics, every: every, keep: min(maxSamples, int(sampleWindow/every)+1), log: log,
		started: time.Now(), oldest: map[string]*ring{}, backlog: map[string]*ring{}, stop: stop, done: make(chan struct{})}
	go s.run(ctx)
	return s
}

func (s *sampler) run(ctx context.Context) {
	defer close(s.done)
	t := time.NewTicker(s.every)
	defer t.Stop()
	for {
		s.sample(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// close stops the sampling and waits for its goroutine to end; again, it
// returns at once.
func (s *sampler) close() {
	s.stop()
	<-s.done
}

// sample takes one sample of every series and forgets the series no
// longer sampled for an hour (a relay or consumer group gone).
func (s *sampler) sample(ctx context.Context) {
	at := time.Now()
	statuses, err := s.ops.OutboxStatuses(ctx)
	if err != nil && ctx.Err() == nil {
		s.log.Warn("console: sample the outbox's status", "error", err)
	}
	backlogs, err := backlogs(s.metrics)
	if err != nil {
		s.log.Warn("console: sample the consumers' backlog", "metric", bus.MetricConsumerBacklog, "error", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, st := range statuses {
		s.add(s.oldest, st.RelayGroup, sample{at, st.OldestPendingAge.Seconds()})
	}
	for group, n := range backlogs {
		s.add(s.backlog, group, sample{at, n})
	}
	for _, series := range []map[string]*ring{s.oldest, s.backlog} {
		maps.DeleteFunc(series, func(_ string, r *ring) bool { return at.Sub(r.newest()) > sampleWindow })
	}
}

func (s *sampler) add(series map[string]*ring, group string, v sample) {
	r := series[group]
	if r == nil {
		r = &ring{buf: make([]sample, 0, s.keep)}
		series[group] = r
	}
	r.add(v)
}

// history is what the sampler holds from a time on.
type history struct {
	Every   time.Duration
	Started time.Time           // when the sampling started
	Oldest  map[string][]sample // per relay group, in seconds
	Backlog map[string][]sample // per consumer group, in messages
	// Metrics says whether the console has the consumers' metrics at all.
	Metrics bool
}

// since returns copies of the samples taken at from or later.
func (s *sampler) since(from time.Time) history {
	h := history{Every: s.every, Started: s.started, Oldest: map[string][]sample{}, Backlog: map[string][]sample{}, Metrics: s.metrics != nil}
	s.mu.Lock()
	defer s.mu.Unlock()
	for group, r := range s.oldest {
		h.Oldest[group] = r.since(from)
	}
	for group, r := range s.backlog {
		h.Backlog[group] = r.since(from)
	}
	return h
}

// backlogs sums millrace_consumer_backlog per consumer group, as g
// gathers it; none without g. A gathering that failed in part still
// returns what it gathered.
func backlogs(g prometheus.Gatherer) (map[string]float64, error) {
	if g == nil {
		return nil, nil
	}
	families, err := g.Gather()
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != bus.MetricConsumerBacklog {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "consumer_group" {
					out[l.GetValue()] += m.GetGauge().GetValue()
				}
			}
		}
	}
	return out, err
}
