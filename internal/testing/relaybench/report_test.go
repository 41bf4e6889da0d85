package relaybench_test

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// perfDocEnv names the file `make bench` has the relay tables written to
// (docs/PERFORMANCE.md); unset, nothing is written.
const perfDocEnv = "MILLRACE_PERFORMANCE_DOC"

// The relay section of the performance doc lies between these two lines;
// the rest of the file is left as it is.
const (
	beginMarker = "<!-- relaybench:begin"
	endMarker   = "<!-- relaybench:end -->"
)

// machine is where and when the benchmark ran, as the doc states it.
type machine struct {
	cores              int
	goVersion, target  string // go1.26.8; linux/amd64
	start, end         time.Time
	loadBefore, loadUp float64 // 1-minute load average before, and the most seen during the run
	loadKnown          bool    // false where /proc/loadavg does not exist
}

var (
	runMu  sync.Mutex
	runNow = machine{cores: runtime.NumCPU(), goVersion: runtime.Version(), target: runtime.GOOS + "/" + runtime.GOARCH}
)

// startRun records the machine and its load before the first benchmark.
func startRun() {
	runMu.Lock()
	defer runMu.Unlock()
	runNow.start = time.Now().UTC()
	runNow.loadBefore, runNow.loadKnown = loadAverage()
	runNow.loadUp = runNow.loadBefore
}

// sampleLoad records the load average after one relay's measurement.
func sampleLoad() {
	runMu.Lock()
	defer runMu.Unlock()
	if l, ok := loadAverage(); ok {
		runNow.loadUp = max(runNow.loadUp, l)
	}
}

// finishRun returns the machine with the run's end time and last load.
func finishRun() machine {
	sampleLoad()
	runMu.Lock()
	defer runMu.Unlock()
	m := runNow
	m.end = time.Now().UTC()
	return m
}

// loadAverage is the 1-minute load average, on Linux.
func loadAverage() (float64, bool) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0, false
	}
	fields := strings.Fields(string(b))
	if len(fields) == 0 {
		return 0, false
	}
	l, err := strconv.ParseFloat(fields[0], 64)
	return l, err == nil
}

// writePerformanceDoc rewrites the relay section of the doc at path with
// the tables of rs, when rs covers every broker and relay (a run of one
// broker, -bench 'BenchmarkRelay/nats', leaves the doc alone).
func writePerformanceDoc(path string, m machine, rs []result) error {
	if missing := missingResults(rs); len(missing) > 0 {
		fmt.Fprintf(os.Stderr, "relaybench: %s not rewritten, the run lacks %s\n", path, strings.Join(missing, ", "))
		return nil
	}
	old, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	doc, err := replaceSection(string(old), relayMarkdown(m, rs))
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return os.WriteFile(path, []byte(doc), 0o644)
}

// missingResults names the broker/relay pairs rs has no result for.
func missingResults(rs []result) []string {
	var missing []string
	for _, kind := range brokerKinds() {
		for _, relay := range relays {
			if !slices.ContainsFunc(rs, func(r result) bool { return r.kind == kind && r.relay == relay }) {
				missing = append(missing, kind+"/"+relay)
			}
		}
	}
	return missing
}

// brokerKinds are the brokers measured, in the order BenchmarkRelay runs them.
func brokerKinds() []string {
	kinds := make([]string, 0, len(brokers))
	for k := range brokers {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	return kinds
}

// replaceSection puts section between the begin and end markers of doc,
// keeping both marker lines and everything outside them.
func replaceSection(doc, section string) (string, error) {
	begin := strings.Index(doc, beginMarker)
	if begin < 0 {
		return "", errors.New("no line starting with " + beginMarker)
	}
	afterBegin := strings.IndexByte(doc[begin:], '\n')
	if afterBegin < 0 {
		return "", errors.New("nothing after " + beginMarker)
	}
	afterBegin += begin + 1
	end := strings.Index(doc[afterBegin:], endMarker)
	if end < 0 {
		return "", errors.New("no " + endMarker + " after " + beginMarker)
	}
	end += afterBegin
	return doc[:afterBegin] + strings.TrimRight(section, "\n") + "\n" + doc[end:], nil
}

// brokerTitles are the table titles of the brokers.
var brokerTitles = map[string]string{
	"kafka":    "Kafka (acks=all; kfake unless KAFKA_BROKERS names a cluster)",
	"nats":     "NATS JetStream",
	"rabbitmq": "RabbitMQ quorum + confirms",
}

// relayNames are the relays' names in the tables.
var relayNames = map[string]string{
	"watermill": "Watermill forwarder",
	"reference": "reference (ceiling)",
}

// relayMarkdown is the relay section: how and where it was measured, then
// one table per broker.
func relayMarkdown(m machine, rs []result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Written by `make bench` (BenchmarkRelay, internal/testing/relaybench) on %s, %s to %s UTC: %s on %s, %d cores",
		m.start.Format("2006-01-02"), m.start.Format("15:04"), m.end.Format("15:04"), m.goVersion, m.target, m.cores)
	if m.loadKnown {
		fmt.Fprintf(&b, ", load average %.1f before the run and up to %.1f during it", m.loadBefore, m.loadUp)
	}
	rates := make([]string, 0, len(trickles))
	for _, tr := range trickles {
		rates = append(rates, fmt.Sprintf("%s/s for %s", thousands(tr.rate), tr.duration))
	}
	fmt.Fprintf(&b, ". Each relay drained a %s-event backlog; then commit-to-consumer latency was measured at %s",
		thousands(backlogEvents), strings.Join(rates, " and "))
	held := "`" + strings.Join(heldRelays, "`, `") + "`"
	if i := strings.LastIndex(held, ", "); i >= 0 {
		held = held[:i] + " and " + held[i+2:]
	}
	fmt.Fprintf(&b, `, one event per transaction, and, for %s, at %s/s for %s beside a transaction held open (+tx). `,
		held, thousands(heldTrickle.rate), heldTrickle.duration)
	b.WriteString("Every relay ran on one private PostgreSQL, in a schema of its own: initdb, fsync off, max_connections 200, wal_level = logical; the WAL relays (`millrace-wal`: relay.source: wal; `millrace-walmsg`: outbox.mode: wal_messages too) each on a slot of its own made before the backlog and dropped after its run. " +
		"PostgreSQL CPU is the user and system time of the server's processes, and WAL the bytes of write-ahead log written (MB of 2^20 bytes), over the backlog's commit and its drain, per 10,000 events (for `millrace-wal` without most of the slot's decoding, which follows its drain from the table); each relay's window starts after a CHECKPOINT. " +
		"% of ceiling is the drain over the reference's. In the ratio rows the drain is millrace's over the other relay's, and each latency, CPU and WAL the other relay's over millrace's (lower is better: how many times shorter, or less, millrace's is); in the rows of the WAL relays, theirs over the table relay's.\n")
	for _, kind := range brokerKinds() {
		b.WriteString("\n")
		brokerMarkdown(&b, kind, rs)
	}
	return b.String()
}

// brokerMarkdown writes the table of broker kind and its notes.
func brokerMarkdown(b *strings.Builder, kind string, rs []result) {
	byRelay := map[string]result{}
	for _, r := range rs {
		if r.kind == kind {
			byRelay[r.relay] = r
		}
	}
	fmt.Fprintf(b, "**%s**\n\n| relay | drain (msg/s) | %% of ceiling |", cmp.Or(brokerTitles[kind], kind))
	for _, tr := range trickles {
		fmt.Fprintf(b, " p50 at %[1]s/s | p99 at %[1]s/s |", thousands(tr.rate))
	}
	fmt.Fprintf(b, " p50 at %[1]s/s+tx | p99 at %[1]s/s+tx | idle SQL statements/s | peak RSS | duplicates | PostgreSQL CPU per 10k events | WAL per 10k events |\n|---|", thousands(heldTrickle.rate))
	b.WriteString(strings.Repeat("---:|", 2+2*len(trickles)+2+3+2) + "\n")
	ceiling := byRelay["reference"]
	var notes []string
	for _, relay := range relays {
		r, ok := byRelay[relay]
		if !ok {
			continue
		}
		fmt.Fprintf(b, "| %s | %s | %s |", cmp.Or(relayNames[relay], relay), drainCell(r), percent(r, ceiling))
		if r.undrained {
			fmt.Fprintf(b, " did not drain %s events within %s |%s\n", thousands(backlogEvents), drainBound, strings.Repeat(" |", 2*len(trickles)+2+3+2-1))
			continue
		}
		for _, l := range append(slices.Clone(r.latency), r.heldOrZero()) {
			if l.events == 0 {
				b.WriteString(" | |")
				continue
			}
			fmt.Fprintf(b, " %s | %s |", msCell(l.p50), msCell(l.p99))
			if l.achieved < 0.95*float64(l.rate) {
				notes = append(notes, fmt.Sprintf("%s: the %s/s%s trickle reached %s/s",
					r.relay, thousands(l.rate), map[bool]string{true: "+tx"}[l.held], thousands(int(l.achieved))))
			}
		}
		fmt.Fprintf(b, " %.1f | %.0f MB | %d | %.2f s | %.1f MB |\n", r.idleQueries, r.peakRSSMB, r.duplicates, r.pgCPU, r.walMB)
	}
	ratioRow(b, "millrace / Watermill", byRelay["watermill"], byRelay["millrace"])
	ratioRow(b, "millrace / reference", ceiling, byRelay["millrace"])
	ratioRow(b, walRelay+" / millrace", byRelay["millrace"], byRelay[walRelay])
	ratioRow(b, walMessagesRelay+" / millrace", byRelay["millrace"], byRelay[walMessagesRelay])
	for _, n := range notes {
		fmt.Fprintf(b, "\n- %s", n)
	}
	if len(notes) > 0 {
		b.WriteString("\n")
	}
}

// ratioRow writes millrace m's ratios to relay o: m's drain over o's, and
// each of o's latencies, its PostgreSQL CPU and its WAL over m's; nothing
// when either did not drain.
func ratioRow(b *strings.Builder, label string, o, m result) {
	if o.relay == "" || m.relay == "" || o.undrained || m.undrained {
		return
	}
	fmt.Fprintf(b, "| %s | %s | |", label, ratio(m.drainRate/o.drainRate))
	ol, ml := append(slices.Clone(o.latency), o.heldOrZero()), append(slices.Clone(m.latency), m.heldOrZero())
	for i := range ml {
		if i >= len(ol) || ol[i].events == 0 || ml[i].events == 0 || ml[i].p50 <= 0 || ml[i].p99 <= 0 {
			b.WriteString(" | |")
			continue
		}
		fmt.Fprintf(b, " %s | %s |", ratio(float64(ol[i].p50)/float64(ml[i].p50)), ratio(float64(ol[i].p99)/float64(ml[i].p99)))
	}
	b.WriteString(" | | |")
	for _, c := range [][2]float64{{o.pgCPU, m.pgCPU}, {o.walMB, m.walMB}} {
		if c[1] <= 0 {
			b.WriteString(" |")
			continue
		}
		b.WriteString(" " + ratio(c[0]/c[1]) + " |")
	}
	b.WriteString("\n")
}

// drainCell is the drain rate, "<n" for a relay that did not finish.
func drainCell(r result) string {
	if r.undrained {
		return "<" + thousands(int(r.drainRate))
	}
	return thousands(int(r.drainRate + 0.5))
}

// percent is r's drain as a share of the reference's.
func percent(r, ceiling result) string {
	if ceiling.relay == "" || ceiling.drainRate == 0 {
		return ""
	}
	return fmt.Sprintf("%.0f%%", 100*r.drainRate/ceiling.drainRate)
}

// msCell shows d in milliseconds: one decimal below 100 ms, whole
// milliseconds with thousands separators from there.
func msCell(d time.Duration) string {
	v := float64(d.Microseconds()) / 1000
	if v < 100 {
		return strconv.FormatFloat(v, 'f', 1, 64) + " ms"
	}
	return thousands(int(v+0.5)) + " ms"
}

// ratio shows x with two decimals below 10, one below 100, none above.
func ratio(x float64) string {
	switch {
	case x < 10:
		return strconv.FormatFloat(x, 'f', 2, 64) + "x"
	case x < 100:
		return strconv.FormatFloat(x, 'f', 1, 64) + "x"
	}
	return thousands(int(x+0.5)) + "x"
}

// thousands writes n with a comma between groups of three digits.
func thousands(n int) string {
	s := strconv.Itoa(n)
	if n < 0 {
		return "-" + thousands(-n)
	}
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
