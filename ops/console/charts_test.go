package console_test

import (
	"context"
	"fmt"
	"html"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/ops"
	"github.com/millrace-io/millrace/ops/console"
)

// overviewPage renders c's overview.
func overviewPage(t *testing.T, c *console.Console) string {
	t.Helper()
	rec := httptest.NewRecorder()
	c.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	return rec.Body.String()
}

// chartOf returns the chart of kind for group on page: the description of
// its SVG, the values of its bars, or the reason it has none.
func chartOf(page, kind, group string) (desc string, bars []string, missing string) {
	attrs := fmt.Sprintf(`data-chart="%s" data-group="%s"`, kind, group)
	if m := regexp.MustCompile(`<span class="muted" ` + regexp.QuoteMeta(attrs) + `>([^<]*)</span>`).FindStringSubmatch(page); m != nil {
		return "", nil, html.UnescapeString(m[1])
	}
	m := regexp.MustCompile(regexp.QuoteMeta(attrs) + `.*?<desc[^>]*>([^<]*)</desc>(.*?)</svg>`).FindStringSubmatch(page)
	if m == nil {
		return "", nil, ""
	}
	for _, v := range regexp.MustCompile(`data-v="([^"]*)"`).FindAllStringSubmatch(m[2], -1) {
		bars = append(bars, v[1])
	}
	return html.UnescapeString(m[1]), bars, ""
}

// The overview charts each relay group and consumer group of the last
// hour: the rows forwarded and processed per minute from the database, the
// oldest pending age the console sampled, and the lag it sampled from the
// consumers' metrics, given them.
func TestOverviewChartsTheLastHour(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, 0, bus.Config{})
	tables := store.Tables{Schema: f.cfg.Database.Schema, OutboxTopic: "millrace_outbox"}
	tx, err := f.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tables.WriteOutbox(ctx, tx, []*message.Message{message.NewMessage("u-1", []byte(`{}`)), message.NewMessage("u-2", []byte(`{}`))}))
	require.NoError(t, tx.Commit())
	for i := range 4 {
		_, err := tables.MarkProcessed(ctx, f.db, "billing", fmt.Sprintf("e-%d", i))
		require.NoError(t, err)
	}
	reg := prometheus.NewRegistry()
	backlog := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: bus.MetricConsumerBacklog, Help: "as bus.Run registers it"},
		[]string{"handler", "consumer_group", "partition"})
	reg.MustRegister(backlog)
	backlog.WithLabelValues("billing", "billing", "0").Set(2)
	backlog.WithLabelValues("billing", "billing", "1").Set(3)
	backlog.WithLabelValues("audit", "audit", "").Set(1)

	c, err := console.New(f.ops, console.Options{SampleInterval: 50 * time.Millisecond, Metrics: reg})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	var page string
	require.Eventually(t, func() bool {
		page = overviewPage(t, c)
		_, _, missing := chartOf(page, "lag", "audit")
		return !strings.Contains(page, "not sampled yet") && missing == ""
	}, time.Minute, 20*time.Millisecond, "the console's first samples")
	relay := f.ops.Config().Relay.ConsumerGroup

	desc, bars, _ := chartOf(page, "forwarded", relay)
	require.Contains(t, desc, "total 0 over the last hour", "both rows are pending")
	require.Len(t, bars, ops.ThroughputMinutes, "a bar per minute")
	desc, _, _ = chartOf(page, "oldest", relay)
	require.Contains(t, desc, "since the console started at")
	require.Regexp(t, `now [0-9.]+m?s\.$`, desc)
	require.NotContains(t, desc, "now 0s.", "two rows pending")

	desc, bars, _ = chartOf(page, "processed", "billing")
	require.Contains(t, desc, "total 4 over the last hour")
	var sum int
	for _, v := range bars {
		var n int
		_, err := fmt.Sscan(v, &n)
		require.NoError(t, err)
		sum += n
	}
	require.Equal(t, 4, sum, "the bars add up to the total")
	desc, _, _ = chartOf(page, "lag", "billing")
	require.Contains(t, desc, "min 5, max 5, now 5.", "both partitions of billing's handler")
	desc, _, _ = chartOf(page, "processed", "audit")
	require.Contains(t, desc, "total 0 over the last hour", "audit has a lag and no inbox row")
	desc, _, _ = chartOf(page, "lag", "audit")
	require.Contains(t, desc, "now 1.")

	backlog.WithLabelValues("audit", "audit", "").Set(0)
	require.Eventually(t, func() bool {
		desc, _, _ := chartOf(overviewPage(t, c), "lag", "audit")
		return strings.Contains(desc, "min 0, max 1, now 0.")
	}, time.Minute, 20*time.Millisecond, "a later sample")

	// Without the consumers' metrics, the console says why it has no lag.
	plain, err := console.New(f.ops, console.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, plain.Close()) })
	desc, _, missing := chartOf(overviewPage(t, plain), "lag", "billing")
	require.Empty(t, desc)
	require.Contains(t, missing, "the console has no metrics of the consumers")
}

// Close stops the console's sampling: no goroutine outlives it. Not in
// parallel: goleak sees every goroutine of the process.
func TestCloseStopsTheSampling(t *testing.T) {
	before := goleak.IgnoreCurrent()
	// Registered first, the check runs last: after the database is closed.
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
	f := newFixture(t, 1, bus.Config{})
	c, err := console.New(f.ops, console.Options{SampleInterval: time.Millisecond})
	require.NoError(t, err)
	overviewPage(t, c)
	require.NoError(t, c.Close())
	require.NoError(t, c.Close(), "a second Close")
	require.Contains(t, overviewPage(t, c), `id="relay-charts"`, "the pages outlive the sampling")

	_, err = console.New(f.ops, console.Options{SampleInterval: -time.Second})
	require.ErrorContains(t, err, "SampleInterval must not be negative")
}
