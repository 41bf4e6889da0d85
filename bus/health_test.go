package bus_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/ops"
	"github.com/millrace-io/millrace/ops/console"
)

// healthConfig is a config whose loops are quiet for at most about 2s, so
// that a stall timeout of 3s tells a wedged loop from a waiting one.
func healthConfig(cfg *bus.Config, listen string) {
	cfg.Metrics.Listen = listen
	cfg.Health.StallTimeout = 3 * time.Second
	cfg.Health.CheckTimeout = time.Second
	cfg.Relay.PollInterval = 200 * time.Millisecond
	cfg.Relay.RetryMax = time.Second
	cfg.Consumer.HandlerTimeout = time.Second
	cfg.Consumer.Retry.MaxInterval = 200 * time.Millisecond
	cfg.Consumer.Breaker.OpenTimeout = time.Second
}

// probe GETs a health endpoint and decodes its report.
func probe(t *testing.T, url string) (int, map[string]bus.HealthCheck) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		return 0, nil // not served yet
	}
	defer resp.Body.Close()
	var r bus.HealthReport
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&r))
	require.Equal(t, resp.StatusCode == http.StatusOK, r.OK, "the status code says what the body says")
	checks := map[string]bus.HealthCheck{}
	for _, c := range r.Checks {
		checks[c.Name] = c
	}
	return resp.StatusCode, checks
}

// waitHealth polls url until its report passes (ok) or fails on the check
// named failing, and returns that report's checks.
func waitHealth(t *testing.T, url string, ok bool, failing string) map[string]bus.HealthCheck {
	t.Helper()
	var last map[string]bus.HealthCheck
	require.Eventually(t, func() bool {
		code, checks := probe(t, url)
		last = checks
		if ok {
			return code == http.StatusOK
		}
		return code == http.StatusServiceUnavailable && checks[failing].Name != "" && !checks[failing].OK
	}, 90*time.Second, 100*time.Millisecond, "%s: want ok=%v (failing %q); last checks %v", url, ok, failing, last)
	return last
}

// stayLive samples liveness n times, 200ms apart, and requires every sample
// to pass.
func stayLive(t *testing.T, base string, n int) {
	t.Helper()
	for range n {
		code, checks := probe(t, base+"/livez")
		require.Equal(t, http.StatusOK, code, "liveness during an outage: %v", checks)
		time.Sleep(200 * time.Millisecond)
	}
}

// Readiness fails while the database or the broker is down and passes
// again once it is back; liveness passes throughout: a relay and a
// consumer retrying through an outage are not wedged.
func TestReadinessFollowsTheDatabaseAndTheBroker(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := servers.StartPostgreSQL(t)
	nats := servers.StartNATS(t)
	db, err := sql.Open("pgx", pg.URL)
	require.NoError(t, err)
	defer db.Close()
	var cfg bus.Config
	cfg.Database.URL = pg.URL
	cfg.Broker.Kind = bus.KindNATS
	cfg.Broker.NATS.URL = nats.URL
	listen := fmt.Sprintf("127.0.0.1:%d", servers.FreePort(t))
	healthConfig(&cfg, listen)
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	b, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, b.Handle("health-ready", "ready-handler", func(context.Context, bus.Event) error { return nil }))

	base := "http://" + listen
	_, checks := probe(t, base+"/readyz")
	require.Nil(t, checks, "nothing is served before Run")
	require.False(t, b.Readiness(ctx).OK, "not ready before Run")
	runCtx, stop := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	go func() { runDone <- b.Run(runCtx) }()

	checks = waitHealth(t, base+"/readyz", true, "")
	for _, name := range []string{"run", "database", "broker", "relay", "handlers"} {
		require.True(t, checks[name].OK, "%s: %v", name, checks[name])
	}
	code, live := probe(t, base+"/livez")
	require.Equal(t, http.StatusOK, code)
	require.True(t, live["relay"].OK && live["handler:ready-handler"].OK, "%v", live)
	resp, err := http.Get(base + "/healthz")
	require.NoError(t, err)
	var both bus.Health
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&both))
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.True(t, both.Live.OK && both.Ready.OK, "%+v", both)

	pg.Stop()
	checks = waitHealth(t, base+"/readyz", false, "database")
	require.True(t, checks["broker"].OK, "only the database is down: %v", checks)
	stayLive(t, base, 25) // 5s of outage, longer than health.stall_timeout
	pg.Start()
	waitHealth(t, base+"/readyz", true, "")

	nats.Stop()
	checks = waitHealth(t, base+"/readyz", false, "broker")
	require.True(t, checks["database"].OK, "only the broker is down: %v", checks)
	stayLive(t, base, 25)
	nats.Start()
	waitHealth(t, base+"/readyz", true, "")

	stop()
	require.NoError(t, <-runDone)
	require.False(t, b.Readiness(ctx).OK, "not ready after Run returned")
}

// Liveness fails when the relay loop or a consumer loop is blocked (a
// statement that never returns), and passes again once it moves on.
// Readiness fails while a handler is stuck past handler_timeout.
func TestLivenessFailsWhenALoopIsWedged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	listen := fmt.Sprintf("127.0.0.1:%d", servers.FreePort(t))
	svc := brokertest.NewService(t, bus.KindNATS, func(cfg *bus.Config) {
		healthConfig(cfg, listen)
		cfg.Consumer.Retry.MaxAttempts = 1
	})
	db, cfg := svc.DB, svc.Config
	b := svc.Open(t)
	topic := "health-" + cfg.Database.Schema[len(cfg.Database.Schema)-8:]
	brokertest.Cleanup(t, bus.KindNATS, topic, "wedge-handler")
	release, gate := make(chan struct{}), make(chan struct{})
	handled := make(chan string, 10)
	require.NoError(t, b.Handle(topic, "wedge-handler", func(ctx context.Context, ev bus.Event) error {
		handled <- ev.Type
		switch ev.Type {
		case "Reject":
			<-gate
			return bus.Permanent(errors.New("rejected"))
		case "Hang":
			<-release // ignores its context
		}
		return nil
	}))
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go b.Run(runCtx)
	base := "http://" + listen
	waitHealth(t, base+"/readyz", true, "")
	publish := func(typ string) {
		require.NoError(t, b.PublishInOwnTx(ctx, topic, bus.Event{Type: typ, AggregateType: "a", AggregateID: typ, Payload: []byte(`{}`)}))
	}
	publish("Ok")
	require.Equal(t, "Ok", <-handled)

	// The relay blocks recording its position in its cursor row, which
	// another transaction holds, once it has an event to ack.
	lock, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = lock.Exec(`SELECT 1 FROM "` + cfg.Database.Schema + `"."millrace_relay_cursors" FOR UPDATE`)
	require.NoError(t, err)
	publish("Ok")
	checks := waitHealth(t, base+"/livez", false, "relay")
	require.Contains(t, checks["relay"].Detail, "blocked")
	require.True(t, checks["handler:wedge-handler"].OK, "the consumer is idle: %v", checks)
	require.NoError(t, lock.Rollback())
	require.Equal(t, "Ok", <-handled)
	waitHealth(t, base+"/livez", true, "")

	// The consumer blocks storing a poisoned message in a locked poison
	// table. The lock is taken once the relay has forwarded the message, so
	// that the relay's ack does not wait for it.
	publish("Reject")
	require.Equal(t, "Reject", <-handled)
	lock, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = lock.Exec(`LOCK TABLE "` + cfg.Database.Schema + `"."millrace_poison" IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	close(gate)
	checks = waitHealth(t, base+"/livez", false, "handler:wedge-handler")
	require.Contains(t, checks["handler:wedge-handler"].Detail, "1 message(s) in the chain")
	require.True(t, checks["relay"].OK, "the relay moves on: %v", checks)
	require.NoError(t, lock.Rollback())
	waitHealth(t, base+"/livez", true, "")

	// A handler that ignores its context is stuck once handler_timeout passed.
	publish("Hang")
	require.Equal(t, "Hang", <-handled)
	checks = waitHealth(t, base+"/readyz", false, "handlers")
	require.Contains(t, checks["handlers"].Detail, "wedge-handler (1)")
	close(release)
	waitHealth(t, base+"/readyz", true, "")
	code, _ := probe(t, base+"/livez")
	require.Equal(t, http.StatusOK, code)
}

// HealthHandler answers on any prefix a service mounts it under, and only
// for its three names.
func TestHealthHandlerPaths(t *testing.T) {
	t.Parallel()
	b := brokertest.NewService(t, bus.KindNATS).Open(t) // not run: not ready
	mux := http.NewServeMux()
	mux.Handle("/ops/", http.StripPrefix("/ops", b.HealthHandler()))
	for path, want := range map[string]int{
		"/ops/livez": http.StatusOK, "/ops/readyz": http.StatusServiceUnavailable,
		"/ops/healthz": http.StatusServiceUnavailable, "/ops/other": http.StatusNotFound,
	} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		require.Equal(t, want, rec.Code, path)
		if want != http.StatusNotFound {
			require.True(t, strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json"), path)
		}
	}
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/ops/livez", nil))
	require.Equal(t, http.StatusMethodNotAllowed, rec.Code)
}

// A relay statement waiting for a lock that another transaction holds (an
// operator's SELECT FOR UPDATE on the relay's cursor, left idle in
// transaction) is reported with that transaction's pid, application_name,
// state, age and query: readiness says degraded, outbox status lists it,
// the console shows it, and the relay's gauges measure it. Once the
// transaction ends the event goes through and readiness is ok again.
func TestTheRelayReportsTheTransactionItWaitsFor(t *testing.T) {
	t.Parallel()
	r := newRelayWaitRig(t)
	r.publish("first")
	require.Equal(t, "first", <-r.handled)

	lock, holder := r.lockTheCursor()
	r.publish("second")
	r.checkReadinessNamesTheHolder(holder)
	r.checkOpsAndConsoleListTheWait(holder)
	metrics := scrapeMetrics(t, r.base)
	require.Contains(t, metrics, fmt.Sprintf(`pid="%d"`, holder), "millrace_relay_blocker_age_seconds names the holder")
	require.Regexp(t, `millrace_relay_blocked_seconds\{[^}]*\} [1-9]`, metrics)

	require.NoError(t, lock.Rollback())
	require.Equal(t, "second", <-r.handled)
	require.Eventually(t, func() bool {
		code, checks := probe(t, r.base+"/readyz")
		return code == http.StatusOK && !checks["relay"].Degraded
	}, 90*time.Second, 100*time.Millisecond, "readiness to be ok again")
}

// relayWaitRig is a NATS service with health endpoints and one handler
// that reports what it handles on handled.
type relayWaitRig struct {
	t       *testing.T
	db      *sql.DB
	cfg     bus.Config
	b       *bus.Bus
	topic   string
	base    string // the health and metrics server's URL
	handled chan string
}

// newRelayWaitRig runs the service and waits until it is ready.
func newRelayWaitRig(t *testing.T) *relayWaitRig {
	ctx := context.Background()
	listen := fmt.Sprintf("127.0.0.1:%d", servers.FreePort(t))
	s := brokertest.NewService(t, bus.KindNATS, func(cfg *bus.Config) {
		healthConfig(cfg, listen)
		cfg.Relay.BacklogInterval = 100 * time.Millisecond
	})
	r := &relayWaitRig{t: t, db: s.DB, cfg: s.Config, handled: make(chan string, 10)}
	b := s.Open(t)
	r.b = b
	r.topic = "waits-" + r.cfg.Database.Schema[len(r.cfg.Database.Schema)-8:]
	brokertest.Cleanup(t, bus.KindNATS, r.topic, "waits-handler")
	require.NoError(t, b.Handle(r.topic, "waits-handler", func(ctx context.Context, ev bus.Event) error {
		r.handled <- ev.AggregateID
		return nil
	}))
	runCtx, stop := context.WithCancel(ctx)
	t.Cleanup(stop)
	go b.Run(runCtx)
	r.base = "http://" + listen
	waitHealth(t, r.base+"/readyz", true, "")
	return r
}

// publish publishes an event of aggregate id.
func (r *relayWaitRig) publish(id string) {
	require.NoError(r.t, r.b.PublishInOwnTx(context.Background(), r.topic, bus.Event{Type: "T", AggregateType: "a", AggregateID: id, Payload: []byte(`{}`)}))
}

// lockTheCursor locks the relay's cursor in a transaction left idle, as
// an operator's SELECT FOR UPDATE would, and returns it with its pid.
func (r *relayWaitRig) lockTheCursor() (*sql.Tx, int32) {
	t := r.t
	lock, err := r.db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback() })
	var holder int32
	require.NoError(t, lock.QueryRow(`SELECT pg_backend_pid()`).Scan(&holder))
	_, err = lock.Exec(`SELECT 1 FROM "` + r.cfg.Database.Schema + `"."millrace_relay_cursors" FOR UPDATE`)
	require.NoError(t, err)
	return lock, holder
}

// checkReadinessNamesTheHolder: readiness says the relay is degraded,
// waiting for the holder's transaction.
func (r *relayWaitRig) checkReadinessNamesTheHolder(holder int32) {
	t := r.t
	var relay bus.HealthCheck
	require.Eventually(t, func() bool {
		_, checks := probe(t, r.base+"/readyz")
		relay = checks["relay"]
		return relay.Degraded
	}, 90*time.Second, 100*time.Millisecond, "readiness to say the relay waits")
	require.True(t, relay.OK, "a waiting relay is ready, degraded")
	require.Contains(t, relay.Detail, fmt.Sprintf("pid %d", holder))
	require.Contains(t, relay.Detail, "idle in transaction")
}

// checkOpsAndConsoleListTheWait: outbox status and the console list the
// holder's transaction.
func (r *relayWaitRig) checkOpsAndConsoleListTheWait(holder int32) {
	t, ctx := r.t, context.Background()
	oc, err := ops.New(ctx, r.db, r.cfg)
	require.NoError(t, err)
	st, err := oc.OutboxStatus(ctx, "")
	require.NoError(t, err)
	require.NotEmpty(t, st.Waits, "outbox status lists the wait")
	w := st.Waits[0]
	require.Equal(t, holder, w.PID)
	require.Equal(t, "idle in transaction", w.State)
	require.Contains(t, w.Query, "FOR UPDATE")
	require.GreaterOrEqual(t, w.Waited, time.Second)

	page := httptest.NewRecorder()
	handler, err := console.New(oc, console.Options{})
	require.NoError(t, err)
	defer handler.Close()
	handler.ServeHTTP(page, httptest.NewRequest(http.MethodGet, "/", nil))
	require.Contains(t, page.Body.String(), `id="relay-waits"`)
	require.Contains(t, page.Body.String(), fmt.Sprintf("<td class=\"num\">%d</td>", holder))
}

// scrapeMetrics returns the text of base's /metrics.
func scrapeMetrics(t *testing.T, base string) string {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	var body strings.Builder
	_, err = io.Copy(&body, resp.Body)
	require.NoError(t, err)
	return body.String()
}
