package faults

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/bus"
)

// A node writes its goroutines, grouped by stack, between these lines on
// SIGUSR1: what a stalled scenario's failure shows of each node.
const (
	dumpBegin = "--- goroutines ---"
	dumpEnd   = "--- end of goroutines ---"
)

// dumpGoroutinesOnSignal makes this process answer SIGUSR1 with its
// goroutines on stderr.
func dumpGoroutinesOnSignal() {
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	go func() {
		for range usr1 {
			var b strings.Builder
			_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
			fmt.Fprintf(os.Stderr, "%s\n%s\n%s\n", dumpBegin, b.String(), dumpEnd)
		}
	}()
}

// diagnose says what the broker holds for the world's consumer group and
// what every live node's goroutines are doing: for the failure
// message of a flow that stalled.
func (w *world) diagnose() string {
	var b strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if broker, err := bus.OpenBroker(ctx, w.cfg, nil); err != nil {
		fmt.Fprintf(&b, "broker: %v\n", err)
	} else {
		if broker.Capabilities().Backlog {
			backlog, err := broker.Backlog(ctx, w.topic, w.handler)
			fmt.Fprintf(&b, "broker backlog of %s: %v %v\n", w.handler, backlog, err)
		}
		_ = broker.Close()
	}
	if w.kind == bus.KindKafka {
		b.WriteString(w.kafkaGroup(ctx))
	}
	for _, n := range w.snapshot() {
		select {
		case <-n.proc.Done():
			continue
		default:
		}
		fmt.Fprintf(&b, "node %s: %s\n", n.name, n.goroutines())
	}
	return b.String()
}

// kafkaGroup describes the world's consumer group: its state and which
// member holds which partitions.
func (w *world) kafkaGroup(ctx context.Context) string {
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.cfg.Broker.Kafka.Brokers...))
	if err != nil {
		return fmt.Sprintf("kafka group: %v\n", err)
	}
	defer cl.Close()
	groups, err := kadm.NewClient(cl).DescribeGroups(ctx, w.handler)
	if err != nil {
		return fmt.Sprintf("kafka group: %v\n", err)
	}
	var b strings.Builder
	for _, g := range groups {
		fmt.Fprintf(&b, "kafka group %s: state %s, protocol %s, %d members (err %v)\n", g.Group, g.State, g.Protocol, len(g.Members), g.Err)
		for _, m := range g.Members {
			var parts []int32
			if c, ok := m.Assigned.AsConsumer(); ok {
				for _, t := range c.Topics {
					parts = append(parts, t.Partitions...)
				}
			}
			fmt.Fprintf(&b, "  member %s (%s): partitions %v\n", m.MemberID, m.ClientHost, parts)
		}
	}
	return b.String()
}

// goroutines asks the node for its goroutines and returns them grouped by
// stack, without the groups that are the runtime's alone.
func (n *node) goroutines() string {
	from := n.stderr.Len()
	if err := syscall.Kill(n.proc.Pid(), syscall.SIGUSR1); err != nil {
		return err.Error()
	}
	deadline := time.Now().Add(5 * time.Second)
	var dump string
	for time.Now().Before(deadline) {
		out := n.stderr.String()[from:]
		if i, j := strings.Index(out, dumpBegin), strings.Index(out, dumpEnd); i >= 0 && j > i {
			dump = out[i+len(dumpBegin) : j]
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if dump == "" {
		return "no goroutine dump within 5s"
	}
	var kept []string
	for _, group := range strings.Split(dump, "\n\n") {
		if stack := compactStack(group); strings.Contains(stack, "\n  ") { // a frame beyond the runtime's
			kept = append(kept, stack)
		}
	}
	return fmt.Sprintf("%d goroutine groups:\n%s", len(kept), head(strings.Join(kept, ""), 12000))
}

func head(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// compactStack shortens one group of a goroutine dump (debug=1): its count,
// then one "function file:line" per frame.
func compactStack(group string) string {
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimSpace(group), "\n") {
		if count, _, ok := strings.Cut(line, " @ "); ok {
			b.WriteString(count + " goroutines:\n")
			continue
		}
		f := strings.Split(line, "\t") // "#", pc, function+offset, file:line
		if len(f) < 4 {
			continue
		}
		fn, _, _ := strings.Cut(f[2], "+0x")
		if slices.ContainsFunc(runtimeFrames, func(p string) bool { return strings.HasPrefix(fn, p) }) {
			continue
		}
		fmt.Fprintf(&b, "  %s %s\n", fn, filepath.Base(strings.TrimSpace(f[len(f)-1])))
	}
	return b.String()
}

// runtimeFrames are the prefixes of the frames compactStack leaves out: the
// standard library's waiting and reading.
var runtimeFrames = []string{"runtime.", "runtime/", "internal/", "net.", "io.", "bufio.", "sync.", "database/sql.withLock"}

// withoutDumps is a node's stderr without the goroutine dumps in it.
func withoutDumps(stderr string) string {
	for {
		i := strings.Index(stderr, dumpBegin)
		if i < 0 {
			return stderr
		}
		j := strings.Index(stderr[i:], dumpEnd)
		if j < 0 {
			return stderr[:i]
		}
		stderr = stderr[:i] + stderr[i+j+len(dumpEnd):]
	}
}

// logKey matches the first key=value field of a log line, where its message
// ends.
var logKey = regexp.MustCompile(` [A-Za-z_][A-Za-z0-9_.]*=`)

// clientLogs sums up the warnings and errors the world's nodes logged (the
// relay's and the consumers' broker clients among them), by message, most
// frequent first, for a scenario's note.
func (w *world) clientLogs() string {
	counts := map[string]int{}
	for _, n := range w.snapshot() {
		for line := range strings.SplitSeq(withoutDumps(n.stderr.String()), "\n") {
			f := strings.SplitN(line, " ", 4) // date, time, level, message and fields
			if len(f) < 4 || (f[2] != "WARN" && f[2] != "ERROR") {
				continue
			}
			msg := f[3]
			if loc := logKey.FindStringIndex(msg); loc != nil {
				msg = msg[:loc[0]]
			}
			counts[f[2]+` "`+msg+`"`]++
		}
	}
	if len(counts) == 0 {
		return "the nodes logged no warning or error"
	}
	keys := slices.Collect(maps.Keys(counts))
	slices.SortFunc(keys, func(a, b string) int { return cmp.Or(cmp.Compare(counts[b], counts[a]), cmp.Compare(a, b)) })
	parts := make([]string, 0, len(keys))
	for _, k := range keys[:min(len(keys), 6)] {
		parts = append(parts, fmt.Sprintf("%d× %s", counts[k], k))
	}
	if len(keys) > 6 {
		parts = append(parts, fmt.Sprintf("%d more kinds", len(keys)-6))
	}
	return "the nodes logged " + strings.Join(parts, ", ")
}
