package testkit

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestMetricSumsTheMatchingSeries(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total", Help: "c"}, []string{"handler", "outcome"})
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "g", Help: "g"}, []string{"handler"})
	reg.MustRegister(c, g)
	c.WithLabelValues("a", "ok").Add(2)
	c.WithLabelValues("a", "nacked").Add(3)
	c.WithLabelValues("b", "ok").Add(5)
	g.WithLabelValues("a").Set(7)
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"c_total", map[string]string{"handler": "a", "outcome": "ok"}, 2},
		{"c_total", map[string]string{"handler": "a"}, 5},
		{"c_total", nil, 10},
		{"c_total", map[string]string{"outcome": ""}, 0}, // every series has an outcome
		{"c_total", map[string]string{"handler": "c"}, 0},
		{"g", map[string]string{"handler": "a", "outcome": ""}, 7}, // a label g lacks counts as ""
		{"missing", nil, 0},
	} {
		if got := Metric(t, reg, tc.name, tc.labels); got != tc.want {
			t.Errorf("Metric(%s, %v) = %v, want %v", tc.name, tc.labels, got, tc.want)
		}
	}
}

func TestStartAndStop(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	r := Start(t, func(ctx context.Context) error { <-ctx.Done(); return boom })
	if err := r.Stop(t, time.Minute); !errors.Is(err, boom) {
		t.Fatalf("Stop returns what run returned; got %v", err)
	}

	stuck := make(chan struct{})
	defer close(stuck)
	rec := &fatalRecorder{TB: t}
	r = Start(t, func(context.Context) error { <-stuck; return nil })
	r.Stop(rec, 10*time.Millisecond)
	if !strings.HasPrefix(rec.msg, "Run did not return within") {
		t.Fatalf("a run that ignores its context fails the test; got %q", rec.msg)
	}
}
