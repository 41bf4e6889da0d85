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

	"github.com/millrace-io/millrace/internal/testing/testkit/child"
)

// reportEnv names the file `make reliability` has the results written to.
const reportEnv = "MILLRACE_RELIABILITY_DOC"

func TestMain(m *testing.M) {
	if child.Role() == nodeRole {
		os.Exit(runNode(os.Getenv(nodeEnv)))
	}
	flag.Parse()
	// A scenario spends most of its time waiting on its child processes and
	// servers (the relay-outage ones, five minutes in `make reliability`), so more of them run at
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
	// latency is the commit-to-effect latency of the events committed
	// during the fault; record fills in that of every event the writer
	// committed at a rate when the scenario measures none of its own.
	latency latency
	// knownLoss is what the fault loses by its nature (an asynchronous
	// standby's missing WAL), shown beside Lost; "" for none.
	knownLoss string
	note      string
}

var (
	resultsMu sync.Mutex
	results   []result
)

// record adds r to the report.
func (w *world) record(r result) {
	w.t.Helper()
	if r.latency.events == 0 {
		r.latency = w.latency(time.Time{}, time.Now())
	}
	w.t.Logf("%s: %d committed, %d lost, %d duplicated; recovery %s; commit to effect %s; %s",
		r.faults, r.o.committed, r.o.lost, r.o.duplicated, r.recovery.Round(100*time.Millisecond), r.latency, r.note)
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
	b.WriteString(reportIntro())
	for _, r := range rows {
		b.WriteString(r.tableRow())
	}
	b.WriteString("\nNotes from the run:\n\n")
	for _, r := range rows {
		if r.note != "" {
			fmt.Fprintf(&b, "- %s on %s: %s\n", r.scenario, r.broker, r.note)
		}
	}
	return b.String()
}

// reportIntro is what the report says before its table: how the suite
// runs, what it checks, and the table's head.
func reportIntro() string {
	return `# Reliability

Generated from a run of the fault-injection suite (internal/testing/faults) on
` + time.Now().UTC().Format("2006-01-02") + `, on a 2-core machine, with -race; ` + "`make reliability`" + `
regenerates it, and ` + "`make test`" + ` runs the same scenarios after the other packages
(at 100 events/s instead of 200, and with the relay down 1 minute instead of 5).

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
to the last effect applied. **Commit to effect** is the time from the
service's COMMIT to the insert of its event's effect (p50, p99 and max): in
the PostgreSQL scenarios at the end, over the events committed during the
fault, as each note says; elsewhere over every event the service committed
at its steady rate, faults and all.

The PostgreSQL scenarios run it as production does: a session of the service
idle in transaction, another service's relay on the same server waiting on
its frozen broker, the nodes and the service behind PgBouncer in transaction
mode, a failover to a synchronous or an asynchronous standby. An
asynchronous standby lacks the tail of the old primary's write-ahead log, and
the events and effects committed in it are lost with it: **Lost** shows them
apart, and the check requires that nothing else is lost and nothing applied
twice.

The WAL relay's scenarios (` + "`relay.source: wal`" + `, rows starting "WAL relay")
run the same flow with the relay streaming the outbox's inserts from a
logical replication slot, each on a private PostgreSQL with
` + "`wal_level = logical`" + `: the relay SIGKILLed, PostgreSQL crash-restarted, the
broker frozen, a session idle in transaction for 60 s, and the slot dropped under the
relay. A dropped slot stops the relay with ` + "`wal.ErrNoSlot`" + ` and what to do;
the operator recreates the slot (` + "`millrace wal create-slot`" + `) and starts the
relay again, which first forwards what the outbox table still holds (rows are
deleted only once the broker confirmed them, so nothing is lost; the ones
published again are duplicates the inbox drops) and then streams.

Group commit is on: the consumers run with ` + fmt.Sprintf("`consumer.batch.max_messages: %d`, `max_wait: %s` and %d",
		batchMessages, batchWait, batchWorkers) + ` workers. **Effects per
transaction** is the mean (and the most) effects one inbox transaction
committed. A batch holds messages in flight: an ordered handler has one in
flight on NATS (batches of 1), one per partition on Kafka and one per
aggregate on RabbitMQ, so the scenarios that do not check order run their
consumers unordered, and form batches of several messages on every broker.

The parked-aggregate scenarios run an ordered stream over 20
aggregates in which a bug refuses one event: it is poisoned and parks its
aggregate (` + "`consumer.poison.park`" + `), whose later events are recorded and acked
while the 19 others flow; consumers are SIGKILLed meanwhile and while they
drain the park. The event is then replayed (it and the parked events take
effect, in order) or skipped (the parked events take effect without it). The
check is the same: one effect per event (none for the skipped one), in
version order per aggregate.

| Scenario | Broker | Events committed | Rolled back | Faults injected | Lost | Duplicated effects | Order checked | Effects per transaction | Recovery | Commit to effect |
|---|---|---:|---:|---|---:|---:|---|---:|---:|---|
`
}

// tableRow is r's row of the report's table.
func (r result) tableRow() string {
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
	lost := fmt.Sprint(r.o.lost)
	if r.knownLoss != "" {
		lost += " (" + r.knownLoss + ")"
	}
	return fmt.Sprintf("| %s | %s | %s | %d | %s | %s | %d | %s | %.1f (max %d) | %s | %s |\n", r.scenario, r.broker, events,
		r.o.rolledBack, r.faults, lost, r.o.duplicated, order, r.o.perTransaction(), r.o.largestBatch, recovery, r.latency)
}
