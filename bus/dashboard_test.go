package bus_test

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/brokertest"
	"github.com/millrace-io/millrace/internal/testdb"
)

// The example Grafana dashboard queries only metrics a running service
// exports, with labels they carry.
func TestGrafanaDashboardMatchesExportedMetrics(t *testing.T) {
	t.Parallel()
	dashboard, err := os.ReadFile("../docs/grafana/millrace.json")
	require.NoError(t, err)

	ctx := context.Background()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, bus.KindNATS, &cfg)
	cfg.Consumer.Inbox.CleanupInterval = 50 * time.Millisecond
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	reg := prometheus.NewRegistry()
	b, err := bus.Open(ctx, cfg, db, bus.WithRegistry(reg))
	require.NoError(t, err)
	defer b.Close()
	topic := "dash-" + cfg.Database.Schema[len(cfg.Database.Schema)-8:]
	brokertest.Cleanup(t, bus.KindNATS, topic, "dash-handler")
	done := make(chan struct{}, 1)
	require.NoError(t, b.Handle(topic, "dash-handler", func(context.Context, bus.Event) error {
		done <- struct{}{}
		return nil
	}))
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go b.Run(runCtx)
	require.NoError(t, b.PublishInOwnTx(ctx, topic, bus.Event{Type: "T", AggregateType: "a", AggregateID: "1", Payload: []byte(`{}`)}))
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the event was not handled")
	}

	labels := map[string]map[string]bool{}
	require.Eventually(t, func() bool {
		families, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range families {
			name := mf.GetName()
			if labels[name] == nil {
				labels[name] = map[string]bool{}
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					labels[name][l.GetName()] = true
				}
			}
		}
		_, pruned := labels["millrace_inbox_rows"]
		return pruned
	}, 30*time.Second, 50*time.Millisecond, "the inbox retention runner reports")

	query := regexp.MustCompile(`"expr": "((?:[^"\\]|\\.)*)"`)
	metric := regexp.MustCompile(`millrace_[a-z_]+`)
	by := regexp.MustCompile(`by \(([^)]*)\)`)
	exprs := query.FindAllStringSubmatch(string(dashboard), -1)
	require.NotEmpty(t, exprs)
	for _, e := range exprs {
		expr := e[1]
		for _, name := range metric.FindAllString(expr, -1) {
			name = strings.TrimSuffix(name, "_bucket")
			got, ok := labels[name]
			require.True(t, ok, "dashboard queries %s, which no service exports", name)
			for _, group := range by.FindAllStringSubmatch(expr, -1) {
				for _, l := range strings.Split(group[1], ",") {
					if l = strings.TrimSpace(l); l != "le" {
						require.True(t, got[l], "dashboard groups %s by %q, a label it does not have", name, l)
					}
				}
			}
		}
	}
}
