package testkit

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric sums the counter and gauge values of the series of the metric
// name in g whose labels have the given values (a label a series lacks
// counts as ""); labels it is not given may have any value. It is 0 when
// no series matches.
func Metric(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatalf("gathering metrics: %v", err)
	}
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			if matches(have, labels) {
				sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	return sum
}

// matches says whether have holds every label of want with its value.
func matches(have, want map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}
