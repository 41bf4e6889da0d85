package bus_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testlog"
)

// Failed attempts on every broker (in process on Kafka, scheduled by the
// broker on NATS and RabbitMQ): a typed handler and a typed batch handler
// read each attempt's number in Message.Attempt; each failed attempt is one
// log line at info, each poisoned message one line at warn with its reason,
// nothing of it at error, and every line's attributes come in key order.
func TestAttemptsAndTheirLogLines(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testAttemptsAndTheirLogLines)
}

func testAttemptsAndTheirLogLines(t *testing.T, kind string) {
	const maxAttempts = 3
	ctx := context.Background()
	svc := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Consumer.Retry.MaxAttempts = maxAttempts
		cfg.Consumer.Retry.InitialInterval = 10 * time.Millisecond
		cfg.Consumer.Retry.MaxInterval = 20 * time.Millisecond
		cfg.Consumer.Breaker.Enabled = new(false)
	})
	db, cfg := svc.DB, svc.Config
	suffix := testdb.UniqueName("")[2:]
	name, handler, batch := "orders-"+suffix, "billing-"+suffix, "ledger-"+suffix
	brokertest.Cleanup(t, kind, name, handler, batch)
	var logs testlog.Buffer
	b := svc.Open(t, bus.WithLogger(slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: watermill.LevelTrace}))))

	flaky, doomed, bad := "flaky-"+suffix, "doomed-"+suffix, "bad-"+suffix
	var mu sync.Mutex
	attempts := map[string][]int{} // handler + " " + event id -> Message.Attempt of each call
	record := func(h string, m bus.Message[placedV2]) int {
		mu.Lock()
		defer mu.Unlock()
		attempts[h+" "+m.ID] = append(attempts[h+" "+m.ID], m.Attempt)
		return m.Attempt
	}
	orders := bus.Must(bus.NewTopic[placedV2](name))
	require.NoError(t, orders.Handle(b, handler, func(ctx context.Context, m bus.Message[placedV2]) error {
		attempt := record(handler, m)
		switch {
		case m.ID == doomed, m.ID == flaky && attempt < maxAttempts:
			return errors.New("the payment service timed out")
		case m.ID == bad:
			return bus.Permanent(errors.New("the order total is negative"))
		}
		return nil
	}))
	require.NoError(t, orders.HandleBatch(b, batch, func(ctx context.Context, ms []bus.Message[placedV2]) error {
		failures := bus.BatchFailures{}
		for _, m := range ms {
			if record(batch, m) < maxAttempts && m.ID == flaky {
				failures[m.ID] = errors.New("the ledger is busy")
			}
		}
		return failures
	}))

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	for _, id := range []string{flaky, doomed, bad} {
		ev, err := orders.Event(placedV2{OrderID: id, TotalCents: 4200})
		require.NoError(t, err)
		ev.ID = id
		require.NoError(t, b.PublishInOwnTx(ctx, name, ev))
	}
	testkit.Eventually(t, 2*time.Minute, "flaky handled by both handlers and two events poisoned", func() bool {
		var poisoned int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".millrace_poison`).Scan(&poisoned))
		mu.Lock()
		defer mu.Unlock()
		return poisoned == 2 && len(attempts[handler+" "+flaky]) == maxAttempts && len(attempts[batch+" "+flaky]) == maxAttempts
	})
	stop()
	require.NoError(t, <-done)

	mu.Lock()
	require.Equal(t, map[string][]int{
		handler + " " + flaky: {1, 2, 3}, handler + " " + doomed: {1, 2, 3}, handler + " " + bad: {1},
		batch + " " + flaky: {1, 2, 3}, batch + " " + doomed: {1}, batch + " " + bad: {1},
	}, attempts)
	mu.Unlock()

	requireAttemptLines(t, logLines(t, logs.String()), flaky, doomed, bad)
}

// requireAttemptLines checks the log lines of the flow above: one line per
// failed attempt of flaky (in each of its two handlers) and doomed, a
// warning for each poisoned message with its reason, no error, and
// attributes in one order.
func requireAttemptLines(t *testing.T, lines []logLine, flaky, doomed, bad string) {
	t.Helper()
	about := func(id string) (out []logLine) {
		for _, l := range lines {
			if l.level != "DEBUG" && l.level != "DEBUG-4" && l.has(id) {
				out = append(out, l)
			}
		}
		return out
	}
	requireLines(t, about(flaky), "INFO", "INFO", "INFO", "INFO") // two failed attempts in each handler
	requireLines(t, about(doomed), "INFO", "INFO", "WARN")
	requireLines(t, about(bad), "WARN")
	for id, reason := range map[string]string{doomed: "3 attempts failed, last: the payment service timed out", bad: "the order total is negative"} {
		poisoned := about(id)[len(about(id))-1]
		require.Equal(t, "Message poisoned", poisoned.msg)
		require.Equal(t, reason, poisoned.attrs["reason"])
	}
	for _, l := range slices.Concat(about(flaky), about(doomed), about(bad)) {
		require.True(t, slices.IsSorted(l.keys), "attributes in key order: %s", l.raw)
	}
	// A logger's With attributes come first (in key order too): lines of
	// one kind have their attributes in one order.
	order := map[string]string{}
	for _, l := range lines {
		require.NotEqual(t, "ERROR", l.level, "nothing here is an error of the process: %s", l.raw)
		kind := l.msg + " " + strings.Join(slices.Sorted(slices.Values(l.keys)), ",")
		if first, seen := order[kind]; seen {
			require.Equal(t, first, strings.Join(l.keys, ","), "one order for %q", l.msg)
		}
		order[kind] = strings.Join(l.keys, ",")
	}
}

// logLine is one line of slog's JSON output.
type logLine struct {
	raw, level, msg string
	keys            []string // the attributes' keys in the order written, without time, level and msg
	attrs           map[string]any
}

func (l logLine) has(s string) bool { return strings.Contains(l.raw, s) }

// logLines parses slog's JSON lines, keeping the order of their keys.
func logLines(t *testing.T, out string) []logLine {
	t.Helper()
	var lines []logLine
	for _, raw := range strings.Split(strings.TrimSpace(out), "\n") {
		l := logLine{raw: raw, attrs: map[string]any{}}
		require.NoError(t, json.Unmarshal([]byte(raw), &l.attrs))
		l.level, _ = l.attrs["level"].(string)
		l.msg, _ = l.attrs["msg"].(string)
		dec := json.NewDecoder(bytes.NewReader([]byte(raw)))
		_, err := dec.Token() // {
		require.NoError(t, err)
		for dec.More() {
			key, err := dec.Token()
			require.NoError(t, err)
			var skip json.RawMessage
			require.NoError(t, dec.Decode(&skip))
			if k := key.(string); k != "time" && k != "level" && k != "msg" {
				l.keys = append(l.keys, k)
			}
		}
		_, err = dec.Token() // }
		require.True(t, err == nil || errors.Is(err, io.EOF))
		lines = append(lines, l)
	}
	return lines
}

// requireLines checks the levels of lines, in order.
func requireLines(t *testing.T, lines []logLine, levels ...string) {
	t.Helper()
	got := make([]string, len(lines))
	raws := make([]string, len(lines))
	for i, l := range lines {
		got[i], raws[i] = l.level, l.raw
	}
	require.Equal(t, levels, got, "%s", strings.Join(raws, "\n"))
}
