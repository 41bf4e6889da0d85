package bus_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// exported is what a scrape showed: each series name (histograms' _bucket,
// _sum and _count included) with the label names it carries.
type exported map[string]map[string]bool

// firstScrape runs a service with the relay (relay.source source) and a
// handler and returns its first answer on /metrics, before any event was
// published: everything the dashboard and the alert rules query must be
// there already.
func firstScrape(t *testing.T, source string) exported {
	ctx := context.Background()
	db, cfg := scrapeDatabase(t, source)
	brokertest.Apply(t, bus.KindNATS, &cfg)
	listen := fmt.Sprintf("127.0.0.1:%d", servers.FreePort(t))
	cfg.Metrics.Listen = listen
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	b, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	defer b.Close()
	topic := "dash-" + cfg.Database.Schema[len(cfg.Database.Schema)-8:]
	brokertest.Cleanup(t, bus.KindNATS, topic, "dash-handler")
	require.NoError(t, b.Handle(topic, "dash-handler", func(context.Context, bus.Event) error { return nil }))
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go b.Run(runCtx)
	return scrape(t, "http://"+listen+"/metrics")
}

// scrapeDatabase is the database and config of firstScrape's service: the
// shared server for the table relay, a private one with wal_level =
// logical for the WAL relay.
func scrapeDatabase(t *testing.T, source string) (*sql.DB, bus.Config) {
	var cfg bus.Config
	cfg.Relay.Source = source
	if source != forwarder.SourceWAL {
		db := testdb.Open(t)
		cfg.Database.Schema = testdb.Schema(t, db)
		return db, cfg
	}
	cfg.Database.URL = servers.StartLogicalPostgreSQL(t).URL
	cfg.Database.Schema = testdb.UniqueName(t.Name())
	return testdb.OpenURL(t, cfg.Database.URL), cfg
}

// scrape reads url's metrics, once they are served.
func scrape(t *testing.T, url string) exported {
	var err error
	var resp *http.Response
	require.Eventually(t, func() bool {
		resp, err = http.Get(url)
		return err == nil
	}, 60*time.Second, 10*time.Millisecond, "metrics served")
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	textParser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := textParser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	seen := exported{}
	add := func(name string, labelNames ...string) {
		if seen[name] == nil {
			seen[name] = map[string]bool{"__name__": true}
		}
		for _, l := range labelNames {
			seen[name][l] = true
		}
	}
	for name, mf := range families {
		for _, m := range mf.GetMetric() {
			var names []string
			for _, l := range m.GetLabel() {
				names = append(names, l.GetName())
			}
			add(name, names...)
			if mf.GetType().String() == "HISTOGRAM" {
				add(name+"_bucket", append(names, "le")...)
				add(name+"_sum", names...)
				add(name+"_count", names...)
			}
		}
	}
	return seen
}

// checkExpr fails when expr is not PromQL, or names a metric the scrape
// lacks, or a label (matched or grouped by) that metric lacks.
func checkExpr(t *testing.T, p parser.Parser, seen exported, where, expr string) {
	t.Helper()
	node, err := p.ParseExpr(expr)
	require.NoError(t, err, "%s: %s", where, expr)
	named := 0
	var groups [][]string
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		switch n := n.(type) {
		case *parser.AggregateExpr:
			if !n.Without {
				groups = append(groups, n.Grouping)
			}
		case *parser.VectorSelector:
			got, ok := seen[n.Name]
			require.True(t, ok, "%s queries %s, which a running service does not export from its first scrape", where, n.Name)
			named++
			for _, m := range n.LabelMatchers {
				if m.Name != labels.MetricName {
					require.True(t, got[m.Name], "%s matches %s on label %q, which it does not have", where, n.Name, m.Name)
				}
			}
			for _, g := range groups {
				for _, l := range g {
					require.True(t, got[l], "%s groups %s by %q, a label it does not have", where, n.Name, l)
				}
			}
		}
		return nil
	})
	require.Positive(t, named, "%s names no metric: %s", where, expr)
}

// The alert rules parse with Prometheus's own rule parser, and every query
// of the rules and of the Grafana dashboard names only metrics a running
// service exports from its first scrape, with labels they carry.
func TestAlertRulesAndDashboardQueryExportedMetrics(t *testing.T) {
	t.Parallel()
	p := parser.NewParser(parser.Options{})
	groups, errs := rulefmt.ParseFile("../docs/prometheus/alerts.yaml", false, model.UTF8Validation, p, nil)
	require.Empty(t, errs)
	seen := firstScrape(t, forwarder.SourceTable)
	walSeen := firstScrape(t, forwarder.SourceWAL)
	require.Contains(t, walSeen, "millrace_relay_wal_retained_bytes")
	for _, name := range []string{"go_goroutines", "go_memstats_heap_inuse_bytes", "process_cpu_seconds_total", "process_resident_memory_bytes"} {
		require.Contains(t, seen, name, "Go runtime and process collectors")
	}

	var alerts []string
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			require.NotEmpty(t, r.Alert, "every rule is an alert")
			require.NotEmpty(t, r.Annotations["summary"], r.Alert)
			alerts = append(alerts, r.Alert)
			checkExpr(t, p, scrapeFor(r.Expr, seen, walSeen), "alert "+r.Alert, r.Expr)
		}
	}
	for _, want := range []string{"MillraceOutboxOldestPendingAge", "MillraceDLQGrowing", "MillraceBreakerOpen", "MillraceNoActiveRelay", "MillraceConsumerLag", "MillraceRelayWALRetained", "MillraceAggregatesParked"} {
		require.Contains(t, alerts, want)
	}

	raw, err := os.ReadFile("../docs/grafana/millrace.json")
	require.NoError(t, err)
	var dashboard struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(raw, &dashboard))
	queries := 0
	for _, panel := range dashboard.Panels {
		for _, target := range panel.Targets {
			// Grafana's $__rate_interval and friends are not PromQL.
			expr := strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "1h").Replace(target.Expr)
			checkExpr(t, p, scrapeFor(expr, seen, walSeen), "panel "+panel.Title, expr)
			queries++
		}
	}
	require.Positive(t, queries)
}

// scrapeFor is the scrape to check expr against: the WAL relay's for the
// WAL relay's metrics (millrace_relay_wal_*), which a service with the
// table relay does not export, else the table relay's.
func scrapeFor(expr string, table, wal exported) exported {
	if strings.Contains(expr, "millrace_relay_wal_") {
		return wal
	}
	return table
}
