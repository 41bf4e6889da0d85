package console_test

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"image/png"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/ops"
	"github.com/millrace-io/millrace/ops/console"
)

// chromium finds Debian's chromium (or another Chrome) and fails the test
// when there is none: `make up` installs it.
func chromium(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	for _, app := range []string{"/Applications/Chromium.app/Contents/MacOS/Chromium", "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome"} {
		if _, err := os.Stat(app); err == nil {
			return app // macOS: Homebrew's cask installs an app, not a command
		}
	}
	t.Fatal("no chromium on PATH: run `make up`, which installs chromium (apt-get or Homebrew)")
	return ""
}

// browser starts a headless chromium with a fresh profile and returns its
// context.
func browser(t *testing.T) context.Context {
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium(t)),
		chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 900),
	)
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(func() { cancel(); cancelAlloc() })
	require.NoError(t, chromedp.Do(ctx), "start chromium") // the first call, without a timeout: it owns the browser
	return ctx
}

// do runs steps in the browser, each call bounded by a minute.
func do(t *testing.T, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	require.NoError(t, chromedp.Do(ctx, steps...))
}

// follow runs steps that load a new page (a form's submit, a link's click)
// and waits until that page has loaded, so a later wait cannot be answered by
// the page the steps left.
func follow(t *testing.T, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	resp, err := chromedp.RunResponse(ctx, steps...)
	require.NoError(t, err)
	require.Equal(t, int64(200), resp.Status, "%s", resp.URL)
}

// get runs one action that returns a value, bounded by a minute.
func get[T any](t *testing.T, ctx context.Context, a chromedp.Action[T]) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	v, err := chromedp.Run(ctx, a)
	require.NoError(t, err)
	return v
}

// shoot saves a screenshot of the page as name.png under dir and checks it
// is a picture of something: a PNG of a fair size with many colours.
func shoot(t *testing.T, ctx context.Context, dir, name string) {
	t.Helper()
	buf := get(t, ctx, chromedp.CaptureScreenshot())
	path := filepath.Join(dir, name+".png")
	require.NoError(t, os.WriteFile(path, buf, 0o600))
	info, err := os.Stat(path)
	require.NoError(t, err)
	require.Greater(t, info.Size(), int64(10_000), "%s is too small to show a page", path)
	img, err := png.Decode(bytes.NewReader(buf))
	require.NoError(t, err)
	colours := map[uint32]bool{}
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y += 4 {
		for x := b.Min.X; x < b.Max.X; x += 4 {
			r, g, bl, _ := img.At(x, y).RGBA()
			colours[r>>8<<16|g>>8<<8|bl>>8] = true
		}
	}
	require.Greater(t, len(colours), 20, "%s is blank", path)
	t.Logf("screenshot %s: %d bytes, %dx%d", path, info.Size(), b.Dx(), b.Dy())
}

// serveInBrowser serves oc's console with opts until the test ends, and
// starts a browser.
func serveInBrowser(t *testing.T, oc *ops.Client, opts console.Options) (*httptest.Server, context.Context) {
	h, err := console.New(oc, opts)
	require.NoError(t, err)
	t.Cleanup(func() { h.Close() })
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv, browser(t)
}

// migratedNATS returns the test's pool and a config on NATS, changed by
// tune, whose schema of the test's own is migrated.
func migratedNATS(t *testing.T, tune func(*bus.Config)) (*sql.DB, bus.Config) {
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, bus.KindNATS, &cfg)
	tune(&cfg)
	require.NoError(t, bus.Migrate(context.Background(), db, cfg))
	return db, cfg
}

// The console in a real browser: the outbox page, the DLQ filtered, one
// message, its failure group replayed after the dry run, and the consumer
// processing each replayed event once; a screenshot of each page.
func TestConsoleInABrowser(t *testing.T) {
	t.Parallel()
	r := startConsoleRun(t)
	srv, bctx := serveInBrowser(t, r.oc, console.Options{SampleInterval: 100 * time.Millisecond, Metrics: r.reg})
	shots := t.TempDir()
	browseDLQ(t, bctx, srv.URL, shots)
	r.replayGroup(t, bctx, srv.URL, shots)
	r.checkProcessed(t, bctx, srv.URL, shots)

	checkCharts(t, bctx, srv.URL, r.oc)
	shoot(t, bctx, shots, "outbox-charts")

	do(t, bctx, chromedp.Navigate(srv.URL+"/quarantine"), chromedp.WaitVisible("#empty"))
	shoot(t, bctx, shots, "quarantine")

	// A bad filter typed into the address bar is answered with its reason.
	do(t, bctx, chromedp.Navigate(srv.URL+"/dlq?since=tomorrow"), chromedp.WaitVisible("#error"))
	require.Contains(t, get(t, bctx, chromedp.Text("#error")), `since "tomorrow"`)
}

// consoleRun is TestConsoleInABrowser's service: a handler that refuses
// every event until it is fixed, and the four events it poisoned, three
// of them in one failure group (fp).
type consoleRun struct {
	oc  *ops.Client
	reg *prometheus.Registry
	fp  string

	mu      sync.Mutex
	broken  bool
	effects map[string]int  // event id -> effects once fixed
	events  map[string]bool // the failure group's event ids
}

// startConsoleRun runs the service until its four events are poisoned,
// then fixes the handler.
func startConsoleRun(t *testing.T) *consoleRun {
	ctx := context.Background()
	db, cfg := migratedNATS(t, func(cfg *bus.Config) {
		cfg.Relay.PollInterval = 100 * time.Millisecond
		cfg.Metrics.BacklogInterval = 100 * time.Millisecond
	})
	r := &consoleRun{reg: prometheus.NewRegistry(), broken: true, effects: map[string]int{}, events: map[string]bool{}}
	b, err := bus.Open(ctx, cfg, db, bus.WithRegistry(r.reg))
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	topic := "console-" + cfg.Database.Schema[len(cfg.Database.Schema)-8:]
	brokertest.Cleanup(t, bus.KindNATS, topic, "stock")
	require.NoError(t, b.Handle(topic, "stock", func(_ context.Context, ev bus.Event) error {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.broken || ev.Type == "Unknown" {
			return bus.Permanent(fmt.Errorf("stock for sku %s unavailable", ev.AggregateID))
		}
		r.effects[ev.ID]++
		return nil
	}))
	running := testkit.Start(t, b.Run)
	t.Cleanup(func() { require.NoError(t, running.Stop(t, time.Minute)) })
	for i := range 3 {
		id := fmt.Sprintf("evt-%d-%s", i, cfg.Database.Schema[len(cfg.Database.Schema)-8:])
		r.events[id] = true
		require.NoError(t, b.PublishInOwnTx(ctx, topic, bus.Event{ID: id, Type: "StockReserved", AggregateType: "sku",
			AggregateID: fmt.Sprint(1000 + i), Payload: []byte(fmt.Sprintf(`{"sku":%d,"quantity":2}`, 1000+i))}))
	}
	require.NoError(t, b.PublishInOwnTx(ctx, topic, bus.Event{Type: "Unknown", AggregateType: "sku", AggregateID: "a-b-c", Payload: []byte(`{}`)}))
	r.oc, err = ops.New(ctx, db, cfg)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		l, err := r.oc.DLQ().List(ctx, ops.Filter{}, 0)
		return err == nil && len(l.Rows) == 4
	}, time.Minute, 20*time.Millisecond, "four messages poisoned")
	groups, err := r.oc.PoisonGroups(ctx, ops.Filter{})
	require.NoError(t, err)
	require.Len(t, groups, 2)
	r.fp = groups[0].Fingerprint
	require.Equal(t, int64(3), groups[0].Messages)
	r.mu.Lock()
	r.broken = false
	r.mu.Unlock()
	return r
}

// count counts the elements the page in bctx has for the CSS selector sel.
func count(t *testing.T, bctx context.Context, sel string) int {
	return get(t, bctx, chromedp.Evaluate[int](`document.querySelectorAll(`+"`"+sel+"`"+`).length`))
}

// browseDLQ looks at the outbox page, the DLQ list (selecting all and
// none), the list filtered by reason and one message.
func browseDLQ(t *testing.T, bctx context.Context, base, shots string) {
	do(t, bctx, chromedp.Navigate(base+"/"), chromedp.WaitVisible("#outbox"))
	require.Equal(t, "4", get(t, bctx, chromedp.Text("#waiting-poisoned")))
	shoot(t, bctx, shots, "outbox")

	do(t, bctx, chromedp.Navigate(base+"/dlq"), chromedp.WaitVisible("#messages"))
	require.Equal(t, 4, count(t, bctx, "#messages input[name=id]"))
	disabled := func() bool {
		return get(t, bctx, chromedp.Evaluate[bool](`document.querySelector("#replay-selected").disabled`))
	}
	require.True(t, disabled(), "the console's script disables the selection's actions while nothing is ticked")
	do(t, bctx, chromedp.Click("input[data-select-all]"))
	require.False(t, disabled())
	require.Equal(t, 4, count(t, bctx, "#messages input[name=id]:checked"), "select all")
	do(t, bctx, chromedp.Click("input[data-select-all]"))
	shoot(t, bctx, shots, "dlq")

	do(t, bctx, chromedp.SendKeys(`input[name=reason]`, "sku 10"))
	follow(t, bctx, chromedp.Click("#apply"))
	do(t, bctx, chromedp.WaitVisible(`#messages`))
	require.Contains(t, get(t, bctx, chromedp.Location()), "reason=sku+10")
	require.Equal(t, 3, count(t, bctx, "#messages input[name=id]"), "the filter keeps the three sku 10xx messages")
	shoot(t, bctx, shots, "dlq-filtered")

	follow(t, bctx, chromedp.Click(`#messages tr:nth-child(2) td:nth-child(2) a`))
	do(t, bctx, chromedp.WaitVisible("#payload"))
	require.Contains(t, get(t, bctx, chromedp.Text("#payload")), `"quantity": 2`)
	require.Contains(t, get(t, bctx, chromedp.Text("#reason")), "unavailable")
	require.Contains(t, get(t, bctx, chromedp.Text("#metadata")), "aggregate-id")
	shoot(t, bctx, shots, "message")
}

// replayGroup replays the failure group from its page, through the dry
// run, which replays nothing, and the confirmation.
func (r *consoleRun) replayGroup(t *testing.T, bctx context.Context, base, shots string) {
	do(t, bctx, chromedp.Navigate(base+"/dlq/groups"), chromedp.WaitVisible("#groups"))
	require.Equal(t, 3, count(t, bctx, "#groups tr"), "a header and two groups")
	shoot(t, bctx, shots, "groups")
	follow(t, bctx, chromedp.Click(`button[data-group="`+r.fp+`"]`))
	do(t, bctx, chromedp.WaitVisible("#dry-run"))
	require.Contains(t, get(t, bctx, chromedp.Text("#dry-run")), "3 selected would be replayed as 3 outbox message(s)")
	l, err := r.oc.DLQ().List(context.Background(), ops.Filter{Replayed: new(true)}, 0)
	require.NoError(t, err)
	require.Empty(t, l.Rows, "the dry run replayed nothing")
	shoot(t, bctx, shots, "confirm")
	follow(t, bctx, chromedp.Click("#confirm"))
	do(t, bctx, chromedp.WaitVisible("#done"))
	require.Contains(t, get(t, bctx, chromedp.Text("#done")), "3 replayed as 3 outbox message(s)")
	shoot(t, bctx, shots, "replayed")
}

// checkProcessed waits until the replayed group is processed, checks one
// effect per event, and that the list shows them processed.
func (r *consoleRun) checkProcessed(t *testing.T, bctx context.Context, base, shots string) {
	require.Eventually(t, func() bool {
		l, err := r.oc.DLQ().List(context.Background(), ops.Filter{Fingerprint: r.fp}, 0)
		if err != nil || len(l.Rows) != 3 {
			return false
		}
		for _, m := range l.Rows {
			if m.State != ops.PoisonStateProcessed {
				return false
			}
		}
		return true
	}, time.Minute, 50*time.Millisecond, "the group's events processed")
	r.mu.Lock()
	for id := range r.events {
		require.Equal(t, 1, r.effects[id], "event %s processed once", id)
	}
	require.Len(t, r.effects, 3)
	r.mu.Unlock()
	do(t, bctx, chromedp.Navigate(base+"/dlq?fingerprint="+r.fp), chromedp.WaitVisible("#messages"))
	require.Equal(t, 3, count(t, bctx, "#messages td.state-processed"), "the list shows them processed")
	shoot(t, bctx, shots, "dlq-processed")
}

// checkCharts checks the overview's charts once the events of
// TestConsoleInABrowser are through: seven forwarded by the relay group
// (four published, three replayed), three processed by the consumer group
// stock (the replays; the poisoned attempts wrote no inbox row), and the
// samples of the oldest pending age and the lag at 0 since.
func checkCharts(t *testing.T, bctx context.Context, base string, oc *ops.Client) {
	t.Helper()
	require.Eventually(t, func() bool {
		st, err := oc.OutboxStatus(context.Background(), "")
		return err == nil && st.Pending == 0
	}, time.Minute, 20*time.Millisecond, "the relay's cursor past every event")
	relay := oc.Config().Relay.ConsumerGroup
	chart := func(kind, group string) string {
		return strconv.Quote(fmt.Sprintf(`svg[data-chart=%q][data-group=%q]`, kind, group))
	}
	desc := func(kind, group string) string {
		return `document.querySelector(` + chart(kind, group) + `)?.querySelector("desc")?.textContent ?? ""`
	}
	// The samples catch up with the events: the overview, reloaded until
	// its samples say nothing is pending or unconsumed any more.
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(bctx, 10*time.Second)
		defer cancel()
		if chromedp.Do(ctx, chromedp.Navigate(base+"/"), chromedp.WaitVisible("#relay-charts")) != nil {
			return false
		}
		oldest, err := chromedp.Run(ctx, chromedp.Evaluate[string](desc("oldest", relay)))
		if err != nil {
			return false
		}
		lag, err := chromedp.Run(ctx, chromedp.Evaluate[string](desc("lag", "stock")))
		return err == nil && strings.HasSuffix(oldest, "now 0s.") && strings.HasSuffix(lag, "now 0.")
	}, time.Minute, 100*time.Millisecond, "samples with nothing pending and no lag")
	require.Contains(t, get(t, bctx, chromedp.Evaluate[string](desc("oldest", relay))), "since the console started at")

	bars := func(kind, group string) int {
		return get(t, bctx, chromedp.Evaluate[int](`[...document.querySelectorAll(`+chart(kind, group)+` + " rect")]`+
			`.reduce((n, r) => n + Number(r.dataset.v), 0)`))
	}
	require.Contains(t, get(t, bctx, chromedp.Evaluate[string](desc("forwarded", relay))), "total 7 over the last hour")
	require.Equal(t, 7, bars("forwarded", relay), "the bars add up to the seven events")
	require.Contains(t, get(t, bctx, chromedp.Evaluate[string](desc("processed", "stock"))), "total 3 over the last hour")
	require.Equal(t, 3, bars("processed", "stock"), "the bars add up to the three events")
	require.Equal(t, ops.ThroughputMinutes, get(t, bctx, chromedp.Evaluate[int](`document.querySelectorAll(`+chart("processed", "stock")+` + " rect").length`)))
}

// The saga pages in a real browser: the nav leads to the saga list, whose
// link opens the instance with its state and pending timeout; a screenshot
// of each page.
func TestSagaPagesInABrowser(t *testing.T) {
	t.Parallel()
	f := newSagaFixture(t)
	orders := bus.Must(bus.NewTopic[orderPlaced]("orders.events"))
	ev, err := orders.Event(orderPlaced{orderRef{"o/7"}})
	f.deliver(t, "orders.events", ev, err)
	srv := f.serve(t, console.Options{}, "")
	shots := t.TempDir()
	bctx := browser(t)

	do(t, bctx, chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible("#outbox"))
	follow(t, bctx, chromedp.Click(`nav a[href="/sagas"]`))
	do(t, bctx, chromedp.WaitVisible("#sagas"))
	require.Contains(t, get(t, bctx, chromedp.Text("#sagas")), "o/7")
	shoot(t, bctx, shots, "sagas")

	follow(t, bctx, chromedp.Click(`#sagas a`))
	do(t, bctx, chromedp.WaitVisible("#state"))
	require.Contains(t, get(t, bctx, chromedp.Location()), "/sagas/order_fulfilment/o%2F7")
	require.Contains(t, get(t, bctx, chromedp.Text("#state")), `"Step": "charging"`)
	require.Contains(t, get(t, bctx, chromedp.Text("#timeouts")), "orders.saga-timeouts")
	shoot(t, bctx, shots, "saga")

	follow(t, bctx, chromedp.Click(`nav a[href="/scheduled"]`))
	do(t, bctx, chromedp.WaitVisible("#scheduled"))
	require.Contains(t, get(t, bctx, chromedp.Text("#scheduled")), "PaymentTimedOut")
	shoot(t, bctx, shots, "scheduled")

	do(t, bctx, chromedp.Navigate(srv.URL+"/sagas?state=over"), chromedp.WaitVisible("#error"))
	require.Contains(t, get(t, bctx, chromedp.Text("#error")), `state "over"`)
}

// The parked aggregates page in a real browser: the nav leads to it, it
// lists a held park and a draining one with their counts, and its link
// opens the poisoned message that holds the park, whose skip (dry run,
// then confirmed) releases it; a screenshot of each page.
func TestParkedPageInABrowser(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, cfg := migratedNATS(t, func(*bus.Config) {})
	tables := store.Tables{Schema: cfg.Database.Schema}
	ids := map[string]int64{}
	for i, key := range []string{"sku-held", "sku-draining"} {
		tx, err := db.Begin()
		require.NoError(t, err)
		now := time.Now()
		k := store.ParkKey{Group: "stock", Handler: "stock", Key: key}
		require.NoError(t, tables.StorePoisonedParked(ctx, tx, store.Poisoned{ConsumerGroup: "stock", Handler: "stock", SourceTopic: "stock.events",
			MessageID: key, EventID: key, EventType: "StockReserved", Payload: []byte(`{"quantity":2}`), Metadata: map[string]string{"aggregate-id": key},
			Reason: "stock for " + key + " unavailable", ErrorClass: "permanent", Attempts: 1, FirstFailureAt: now, LastFailureAt: now, PoisonedAt: now},
			k, store.ParkedMessage{MessageID: key, Payload: []byte(`{"quantity":2}`)}))
		require.NoError(t, tx.Commit())
		for j := range 2 + i {
			_, err := tables.AppendParked(ctx, db, k, store.ParkedMessage{MessageID: fmt.Sprintf("%s-%d", key, j)})
			require.NoError(t, err)
		}
		var id int64
		require.NoError(t, db.QueryRow(`SELECT id FROM "`+cfg.Database.Schema+`".millrace_poison WHERE message_id = $1`, key).Scan(&id))
		ids[key] = id
	}
	require.NoError(t, tables.ReleaseParks(ctx, db, []int64{ids["sku-draining"]}, false))
	oc, err := ops.New(ctx, db, cfg)
	require.NoError(t, err)
	srv, bctx := serveInBrowser(t, oc, console.Options{})
	shots := t.TempDir()

	do(t, bctx, chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible("#outbox"))
	follow(t, bctx, chromedp.Click(`nav a[href="/dlq/parked"]`))
	do(t, bctx, chromedp.WaitVisible("#parked"))
	text := get(t, bctx, chromedp.Text("#parked"))
	require.Contains(t, text, "sku-held")
	require.Contains(t, text, "sku-draining")
	require.Equal(t, 1, get(t, bctx, chromedp.Evaluate[int](`document.querySelectorAll("#parked td.state-held").length`)))
	require.Equal(t, 1, get(t, bctx, chromedp.Evaluate[int](`document.querySelectorAll("#parked td.state-draining").length`)))
	shoot(t, bctx, shots, "parked")

	follow(t, bctx, chromedp.Click(`#parked a[href="/dlq/`+strconv.FormatInt(ids["sku-held"], 10)+`"]`))
	do(t, bctx, chromedp.WaitVisible("#reason"))
	require.Contains(t, get(t, bctx, chromedp.Text("#reason")), "stock for sku-held unavailable")
	shoot(t, bctx, shots, "parked-message")
	follow(t, bctx, chromedp.Click("#skip-one"))
	do(t, bctx, chromedp.WaitVisible("#dry-run"))
	require.Contains(t, get(t, bctx, chromedp.Text("#dry-run")), "1 would be skipped for good, releasing 1 parked aggregate(s)")
	follow(t, bctx, chromedp.Click("#confirm"))
	do(t, bctx, chromedp.WaitVisible("#done"))
	require.Contains(t, get(t, bctx, chromedp.Text("#done")), "1 skipped; 1 parked aggregate(s) flow on without them")
	shoot(t, bctx, shots, "parked-skipped")
	do(t, bctx, chromedp.Navigate(srv.URL+"/dlq/parked"), chromedp.WaitVisible("#parked"))
	require.Equal(t, 2, get(t, bctx, chromedp.Evaluate[int](`document.querySelectorAll("#parked td.state-draining").length`)), "both parks drain now")
	m, err := oc.DLQ().Get(ctx, ids["sku-held"])
	require.NoError(t, err)
	require.Equal(t, ops.PoisonStateSkipped, m.State)

	do(t, bctx, chromedp.Navigate(srv.URL+"/dlq/parked?state=stuck"), chromedp.WaitVisible("#error"))
	require.Contains(t, get(t, bctx, chromedp.Text("#error")), `state "stuck"`)
}
