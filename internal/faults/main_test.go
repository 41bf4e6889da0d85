package faults

import (
	"cmp"
	"flag"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/millrace-io/millrace/internal/testkit/child"
)

// reportEnv names the file `make reliability` has the results written to.
const reportEnv = "MILLRACE_RELIABILITY_DOC"

func TestMain(m *testing.M) {
	if child.Role() == nodeRole {
		os.Exit(runNode(os.Getenv(nodeEnv)))
	}
	flag.Parse()
	// A scenario spends most of its time waiting on its child processes and
	// servers (the relay-outage ones, five minutes), so more of them run at
	// once than there are CPUs (unless -parallel says otherwise).
	if !flagSet("test.parallel") {
		_ = flag.Set("test.parallel", fmt.Sprint(max(6, runtime.GOMAXPROCS(0))))
	}
	code := m.Run()
	if path := os.Getenv(reportEnv); path != "" && code == 0 {
		if err := os.WriteFile(path, []byte(report()), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

func flagSet(name string) bool {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// result is one row of docs/RELIABILITY.md.
type result struct {
	scenario, broker string
	faults           string
	o                outcome
	ordered          bool
	recovery         time.Duration
	note             string
}

var (
	resultsMu sync.Mutex
	results   []result
)

func record(r result) {
	resultsMu.Lock()
	defer resultsMu.Unlock()
	results = append(results, r)
}

// report renders the results as docs/RELIABILITY.md.
func report() string {
	resultsMu.Lock()
	defer resultsMu.Unlock()
	rows := slices.Clone(results)
	slices.SortFunc(rows, func(a, b result) int {
		return cmp.Or(cmp.Compare(scenarioRank(a.scenario), scenarioRank(b.scenario)), cmp.Compare(a.broker, b.broker))
	})
	var b strings.Builder
	b.WriteString(`# Reliability

Generated from a run of the fault-injection suite (internal/faults) on
` + time.Now().UTC().Format("2006-01-02") + `, on a 2-core machine, with -race; ` + "`make reliability`" + `
regenerates it, and ` + "`make test`" + ` runs the same scenarios after the other packages.

Every scenario runs the whole path: a service commits events in business
transactions (ten per transaction, every 25th transaction rolled back) ->
outbox -> relay -> broker -> consumer -> inbox and a business effect written in
the inbox transaction. The relay and the consumers are separate processes
(` + "`bus.Run`" + `, as a service runs them) that the suite kills, stops and
restarts; PostgreSQL, RabbitMQ and NATS restarts use servers of the
scenario's own. Kafka is the Kafka protocol over a socket (an in-process kfake
cluster, or a real one named by KAFKA_BROKERS).

After each scenario the suite checks: every committed event has exactly one
effect (**lost** and **duplicated effects** must be 0), no rolled-back event
has an effect, malformed events are in the poison table and nothing else is,
and where millrace promises order (one consumer process with
` + "`consumer.ordered: true`" + `, no failed publish) each aggregate's effects
ran in version order. **Recovery** is the time from the last fault injected
to the last effect applied.

Group commit is on: the consumers run with ` + fmt.Sprintf("`consumer.batch.max_messages: %d`, `max_wait: %s` and %d",
		batchMessages, batchWait, batchWorkers) + ` workers. **Effects per
transaction** is the mean (and the most) effects one inbox transaction
committed. A batch holds messages in flight: an ordered handler has one in
flight on NATS (batches of 1), one per partition on Kafka and one per
aggregate on RabbitMQ, so the scenarios that do not check order run their
consumers unordered, and form batches of several messages on every broker.

| Scenario | Broker | Events committed | Rolled back | Faults injected | Lost | Duplicated effects | Order checked | Effects per transaction | Recovery |
|---|---|---:|---:|---|---:|---:|---|---:|---:|
`)
	for _, r := range rows {
		order := fmt.Sprintf("yes: %d out of order", r.o.outOfOrder)
		if !r.ordered {
			order = fmt.Sprintf("not promised: %d out of order", r.o.outOfOrder)
		}
		events := fmt.Sprint(r.o.committed)
		if r.o.malformed > 0 {
			events = fmt.Sprintf("%d + %d malformed", r.o.committed, r.o.malformed)
		}
		recovery := "n/a (a continuous fault)"
		if r.recovery > 0 {
			recovery = r.recovery.Round(100 * time.Millisecond).String()
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %d | %s | %d | %d | %s | %.1f (max %d) | %s |\n", r.scenario, r.broker, events,
			r.o.rolledBack, r.faults, r.o.lost, r.o.duplicated, order, r.o.perTransaction(), r.o.largestBatch, recovery)
	}
	b.WriteString("\nNotes from the run:\n\n")
	for _, r := range rows {
		if r.note != "" {
			fmt.Fprintf(&b, "- %s on %s: %s\n", r.scenario, r.broker, r.note)
		}
	}
	return b.String()
}
