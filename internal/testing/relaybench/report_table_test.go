package relaybench_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeResults are made-up measurements of every broker and relay: on each
// broker the Kafka row of 2026-12-02's run (PostgreSQL's CPU and WAL made
// up), millrace-3x8 short of the 2,000/s rate, and stock Watermill
// undrained on RabbitMQ.
func fakeResults() []result {
	lat := func(p50, p99 float64, rate int, achieved float64) latency {
		return latency{rate: rate, achieved: achieved, events: 1000,
			p50: time.Duration(p50 * float64(time.Millisecond)), p99: time.Duration(p99 * float64(time.Millisecond))}
	}
	held := func(p50, p99 float64) *latency {
		l := lat(p50, p99, 200, 200)
		l.held = true
		return &l
	}
	var rs []result
	for _, kind := range []string{"kafka", "nats", "rabbitmq"} {
		rs = append(rs,
			result{kind: kind, relay: "watermill", drainRate: 3470, idleQueries: 1, peakRSSMB: 28, pgCPU: 4.2, walMB: 30,
				latency: []latency{lat(526, 993, 200, 200), lat(630, 1007, 2000, 1990)}, held: held(15000, 29800)},
			result{kind: kind, relay: "millrace", drainRate: 70165, idleQueries: 1, peakRSSMB: 49, pgCPU: 1.4, walMB: 12,
				latency: []latency{lat(0.6, 1.1, 200, 200), lat(3.3, 24.5, 2000, 2000)}, held: held(0.7, 1.3)},
			result{kind: kind, relay: "millrace-3x8", drainRate: 61338, idleQueries: 20.4, peakRSSMB: 233, duplicates: 3, pgCPU: 1.6, walMB: 12.5,
				latency: []latency{lat(3.5, 16.1, 200, 200), lat(23.7, 62.7, 2000, 1230)}},
			result{kind: kind, relay: walRelay, drainRate: 35082, idleQueries: 0.4, peakRSSMB: 52, duplicates: 50000, pgCPU: 2.8, walMB: 24,
				latency: []latency{lat(1.2, 2.2, 200, 200), lat(6.6, 49, 2000, 2000)}, held: held(1.4, 2.6)},
			result{kind: kind, relay: walMessagesRelay, drainRate: 140330, idleQueries: 0.4, peakRSSMB: 52, pgCPU: 0.7, walMB: 6,
				latency: []latency{lat(0.3, 0.55, 200, 200), lat(1.65, 12.25, 2000, 2000)}, held: held(0.35, 0.65)},
			result{kind: kind, relay: "reference", drainRate: 64486, idleQueries: 182.6, peakRSSMB: 45, pgCPU: 1.05, walMB: 10.9,
				latency: []latency{lat(3.4, 6.3, 200, 200), lat(5.1, 18.1, 2000, 2000)}},
		)
	}
	rs[12] = result{kind: "rabbitmq", relay: "watermill", drainRate: 930.4, undrained: true}
	return rs
}

var fakeMachine = machine{
	cores: 2, goVersion: "go1.26.8", target: "linux/amd64",
	start: time.Date(2026, 12, 2, 21, 56, 0, 0, time.UTC), end: time.Date(2026, 12, 2, 22, 3, 0, 0, time.UTC),
	loadBefore: 0.1, loadUp: 2.6, loadKnown: true,
}

// The tables: every relay's row, the ratios to stock Watermill and to the
// reference (PostgreSQL's CPU and WAL lower is better, like the latencies),
// an undrained relay, a trickle the writers could not keep, and the
// machine, the date and the server above them.
func TestRelayMarkdownTables(t *testing.T) {
	t.Parallel()
	md := relayMarkdown(fakeMachine, fakeResults())
	for _, want := range []string{
		"on 2026-12-02, 21:56 to 22:03 UTC: go1.26.8 on linux/amd64, 2 cores, load average 0.1 before the run and up to 2.6 during it.",
		"Every relay ran on one private PostgreSQL, in a schema of its own: initdb, fsync off, max_connections 200, wal_level = logical;",
		"50,000-event backlog; then commit-to-consumer latency was measured at 200/s for 5s and 2,000/s for 3s, one event per transaction, and, for `watermill`, `millrace`, `millrace-wal` and `millrace-walmsg`, at 200/s for 30s beside a transaction held open (+tx).",
		"**Kafka (acks=all; kfake unless KAFKA_BROKERS names a cluster)**\n\n" +
			"| relay | drain (msg/s) | % of ceiling | p50 at 200/s | p99 at 200/s | p50 at 2,000/s | p99 at 2,000/s | p50 at 200/s+tx | p99 at 200/s+tx | idle SQL statements/s | peak RSS | duplicates | PostgreSQL CPU per 10k events | WAL per 10k events |\n" +
			"|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n" +
			"| Watermill forwarder | 3,470 | 5% | 526 ms | 993 ms | 630 ms | 1,007 ms | 15,000 ms | 29,800 ms | 1.0 | 28 MB | 0 | 4.20 s | 30.0 MB |\n" +
			"| millrace | 70,165 | 109% | 0.6 ms | 1.1 ms | 3.3 ms | 24.5 ms | 0.7 ms | 1.3 ms | 1.0 | 49 MB | 0 | 1.40 s | 12.0 MB |\n" +
			"| millrace-3x8 | 61,338 | 95% | 3.5 ms | 16.1 ms | 23.7 ms | 62.7 ms | | | 20.4 | 233 MB | 3 | 1.60 s | 12.5 MB |\n" +
			"| millrace-wal | 35,082 | 54% | 1.2 ms | 2.2 ms | 6.6 ms | 49.0 ms | 1.4 ms | 2.6 ms | 0.4 | 52 MB | 50000 | 2.80 s | 24.0 MB |\n" +
			"| millrace-walmsg | 140,330 | 218% | 0.3 ms | 0.6 ms | 1.6 ms | 12.2 ms | 0.3 ms | 0.7 ms | 0.4 | 52 MB | 0 | 0.70 s | 6.0 MB |\n" +
			"| reference (ceiling) | 64,486 | 100% | 3.4 ms | 6.3 ms | 5.1 ms | 18.1 ms | | | 182.6 | 45 MB | 0 | 1.05 s | 10.9 MB |\n" +
			"| millrace / Watermill | 20.2x | | 877x | 903x | 191x | 41.1x | 21,429x | 22,923x | | | | 3.00x | 2.50x |\n" +
			"| millrace / reference | 1.09x | | 5.67x | 5.73x | 1.55x | 0.74x | | | | | | 0.75x | 0.91x |\n" +
			"| millrace-wal / millrace | 0.50x | | 0.50x | 0.50x | 0.50x | 0.50x | 0.50x | 0.50x | | | | 0.50x | 0.50x |\n" +
			"| millrace-walmsg / millrace | 2.00x | | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | | | | 2.00x | 2.00x |\n" +
			"\n- millrace-3x8: the 2,000/s trickle reached 1,230/s\n",
		"| Watermill forwarder | <930 | 1% | did not drain 50,000 events within 4m0s | | | | | | | | | | |\n",
	} {
		require.Contains(t, md, want)
	}
	rabbit := md[strings.Index(md, "**RabbitMQ"):]
	require.NotContains(t, rabbit, "millrace / Watermill", "no ratio to a relay that did not drain")
	require.Contains(t, rabbit, "millrace / reference")
	for _, line := range strings.Split(md, "\n") {
		if strings.HasPrefix(line, "|") {
			require.Equal(t, 15, strings.Count(line, "|"), "every row has the header's 14 cells: %s", line)
		}
	}
}

// The section between the markers is replaced; the text around them and
// the marker lines stay; a doc without the markers is an error.
func TestReplaceSectionKeepsTheRest(t *testing.T) {
	t.Parallel()
	doc := "# Performance\n\nintro\n\n<!-- relaybench:begin: written by make bench -->\nold tables\n\nmore old\n<!-- relaybench:end -->\n\n## Consuming\n\nhand-written\n"
	got, err := replaceSection(doc, "new tables\n\n")
	require.NoError(t, err)
	require.Equal(t, "# Performance\n\nintro\n\n<!-- relaybench:begin: written by make bench -->\nnew tables\n<!-- relaybench:end -->\n\n## Consuming\n\nhand-written\n", got)
	again, err := replaceSection(got, "new tables")
	require.NoError(t, err)
	require.Equal(t, got, again, "rewriting the same tables changes nothing")
	for _, broken := range []string{"no markers\n", "<!-- relaybench:begin -->\nno end\n", "<!-- relaybench:end -->\n<!-- relaybench:begin -->\n"} {
		_, err := replaceSection(broken, "x")
		require.Error(t, err, broken)
	}
}

// The writer rewrites the file of a complete run, leaves it alone after a
// run of one broker, and the repository's docs/PERFORMANCE.md has the
// markers it needs.
func TestWritePerformanceDoc(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "PERFORMANCE.md")
	seed := "# Performance\n\n<!-- relaybench:begin -->\nseed\n<!-- relaybench:end -->\n\nnotes\n"
	require.NoError(t, os.WriteFile(path, []byte(seed), 0o644))

	require.NoError(t, writePerformanceDoc(path, fakeMachine, fakeResults()[:6]))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, seed, string(b), "a partial run leaves the doc as it was")

	require.NoError(t, writePerformanceDoc(path, fakeMachine, fakeResults()))
	b, err = os.ReadFile(path)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(b), "# Performance\n\n<!-- relaybench:begin -->\nWritten by `make bench`"), string(b))
	require.True(t, strings.HasSuffix(string(b), "\n<!-- relaybench:end -->\n\nnotes\n"), string(b))
	require.NotContains(t, string(b), "seed")

	repo, err := os.ReadFile("../../../docs/PERFORMANCE.md")
	require.NoError(t, err)
	_, err = replaceSection(string(repo), "x")
	require.NoError(t, err, "docs/PERFORMANCE.md has the relaybench markers")
}
