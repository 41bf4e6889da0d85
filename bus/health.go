package bus

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path"
	"strings"
	"time"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/middleware"
)

// HealthCheck is one check of a health report.
type HealthCheck struct {
	// Name says what was checked: "run", "database", "broker", "relay",
	// "handler:<name>".
	Name string `json:"name"`
	// OK is true when the check passed.
	OK bool `json:"ok"`
	// Detail says what was found, and why the check failed when it did.
	Detail string `json:"detail"`
	// Degraded is true for a check that passed but found the work slowed
	// down: a relay waiting for a lock another transaction holds, or for a
	// commit to be seen.
	Degraded bool `json:"degraded,omitempty"`
}

// HealthReport is the outcome of the liveness or the readiness checks.
type HealthReport struct {
	// OK is true when every check passed.
	OK bool `json:"ok"`
	// Status is "ok", "degraded" (every check passed, some with Degraded)
	// or "failing".
	Status string `json:"status"`
	// Checks are the checks made, in a stable order.
	Checks []HealthCheck `json:"checks"`
}

// Failed returns the checks that did not pass.
func (r HealthReport) Failed() []HealthCheck {
	var failed []HealthCheck
	for _, c := range r.Checks {
		if !c.OK {
			failed = append(failed, c)
		}
	}
	return failed
}

func report(checks []HealthCheck) HealthReport {
	r := HealthReport{OK: true, Status: "ok", Checks: checks}
	if r.Checks == nil {
		r.Checks = []HealthCheck{}
	}
	if len(r.Failed()) > 0 {
		r.OK, r.Status = false, "failing"
		return r
	}
	for _, c := range r.Checks {
		if c.Degraded {
			r.Status = "degraded"
		}
	}
	return r
}

// Health is a Bus's liveness and readiness at one moment.
type Health struct {
	Live  HealthReport `json:"live"`
	Ready HealthReport `json:"ready"`
}

// Health runs the liveness and the readiness checks.
func (b *Bus) Health(ctx context.Context) Health {
	return Health{Live: b.Liveness(), Ready: b.Readiness(ctx)}
}

// Liveness reports whether the process is wedged: it fails when the relay
// loop, or a handler that holds messages, has not moved on for
// health.stall_timeout. A relay standing by for the lease and an
// idle handler are live; so is a relay retrying through a database or
// broker outage (each retry is a step). Restart a process whose liveness
// fails. Before Run starts, and after it returns, there is nothing to
// wedge: liveness passes.
func (b *Bus) Liveness() HealthReport {
	rs := b.run.Load()
	if rs == nil {
		return report([]HealthCheck{{Name: "run", OK: true, Detail: "not running"}})
	}
	stall := b.cfg.Health.StallTimeout
	now := time.Now()
	var checks []HealthCheck
	if rs.relay != nil {
		st := rs.relay.Status()
		quiet := now.Sub(st.LastTick)
		c := HealthCheck{Name: "relay", OK: true, Detail: fmt.Sprintf("%s, last step %s ago", st.Role, quiet.Round(time.Millisecond))}
		if st.Role != forwarder.RoleStandby && quiet > stall {
			c.OK = false
			c.Detail = fmt.Sprintf("%s, no step for %s (health.stall_timeout is %s): the relay loop is blocked", st.Role, quiet.Round(time.Second), stall)
		}
		checks = append(checks, c)
	}
	for _, chain := range rs.handlers {
		act := chain.Activity(now)
		inChain, quiet := act.InChain, now.Sub(act.Last)
		c := HealthCheck{Name: "handler:" + chain.Handler().Name, OK: true, Detail: "idle"}
		switch {
		case inChain > 0 && quiet > stall:
			c.OK = false
			c.Detail = fmt.Sprintf("%d message(s) in the chain and no step for %s (health.stall_timeout is %s): the consumer loop is blocked",
				inChain, quiet.Round(time.Second), stall)
		case inChain > 0:
			c.Detail = fmt.Sprintf("%d message(s) in the chain, last step %s ago", inChain, quiet.Round(time.Millisecond))
		}
		checks = append(checks, c)
	}
	return report(checks)
}

// Readiness reports whether the Bus can do its work now: Run is running,
// the database answers, the broker answers, the relay knows its role
// (active or standby; not while it is still connecting), and no handler is
// stuck (an attempt abandoned at handler_timeout whose handler has not
// returned). Each probe is bounded by health.check_timeout. Take a process
// whose readiness fails out of service; it becomes ready again by itself.
func (b *Bus) Readiness(ctx context.Context) HealthReport {
	rs := b.run.Load()
	if rs == nil {
		return report([]HealthCheck{{Name: "run", Detail: "Run is not running"}})
	}
	checks := []HealthCheck{{Name: "run", OK: true, Detail: "running"}}
	probe := func(name, okDetail string, f func(context.Context) error) HealthCheck {
		pctx, cancel := context.WithTimeout(ctx, b.cfg.Health.CheckTimeout)
		defer cancel()
		if err := bounded(pctx, f); err != nil {
			return HealthCheck{Name: name, Detail: err.Error()}
		}
		return HealthCheck{Name: name, OK: true, Detail: okDetail}
	}
	checks = append(checks, probe("database", "answered", b.db.PingContext))
	if rs.broker.Capabilities().Ping {
		checks = append(checks, probe("broker", b.cfg.Broker.Kind+" answered", rs.broker.Ping))
	} else {
		checks = append(checks, HealthCheck{Name: "broker", OK: true, Detail: "connected (the adapter cannot be pinged)"})
	}
	if rs.relay != nil {
		checks = append(checks, relayReadiness(rs.relay.Status(), b.cfg.Relay.PollInterval))
	}
	now := time.Now()
	var stuck []string
	for _, chain := range rs.handlers {
		if n := chain.Activity(now).Stuck; n > 0 {
			stuck = append(stuck, fmt.Sprintf("%s (%d)", chain.Handler().Name, n))
		}
	}
	c := HealthCheck{Name: "handlers", OK: len(stuck) == 0, Detail: fmt.Sprintf("%d handler(s), none stuck", len(rs.handlers))}
	if !c.OK {
		c.Detail = "stuck past handler_timeout (abandoned attempts whose handler has not returned): " + strings.Join(stuck, ", ")
	}
	return report(append(checks, c))
}

// bounded runs f and returns its error, or ctx's error when ctx ends first:
// a probe whose client does not honour its context cannot hold the check.
func bounded(ctx context.Context, f func(context.Context) error) error {
	done := make(chan error, 1)
	go func() { done <- f(ctx) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("no answer within health.check_timeout: %w", ctx.Err())
	}
}

// HealthHandler serves the health checks as JSON, for Kubernetes probes or
// a load balancer: a path ending in /livez the liveness report, /readyz the
// readiness report, /healthz both (passing when both pass). A passing
// report answers 200, a failing one 503; other paths 404. Run serves it on
// metrics.listen; a service with its own server mounts it there.
func (b *Bus) HealthHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		var body any
		ok := false
		switch path.Base(r.URL.Path) {
		case "livez":
			live := b.Liveness()
			body, ok = live, live.OK
		case "readyz":
			ready := b.Readiness(r.Context())
			body, ok = ready, ready.OK
		case "healthz":
			h := b.Health(r.Context())
			body, ok = h, h.Live.OK && h.Ready.OK
		default:
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(body)
	})
}

// runState is what the health checks look at while Run runs.
type runState struct {
	broker   adapters.Broker
	relay    *forwarder.Forwarder // nil when relay.enabled is false
	handlers []*middleware.Chain  // sorted by handler name
}

// relayReadiness is the readiness check of a relay with status st: ready
// once it knows its role, degraded while it waits for a lock another
// transaction holds or for a commit to be seen (relay.source: wal), and saying when it polls instead of waking at commits.
func relayReadiness(st forwarder.Status, poll time.Duration) HealthCheck {
	c := HealthCheck{Name: "relay", OK: st.Role != forwarder.RoleStarting, Detail: st.Role.String()}
	if !c.OK {
		c.Detail = "role not known yet: connecting to the database for the lease"
		return c
	}
	if st.Polling {
		c.Detail += fmt.Sprintf(", polling every %s (notifications do not reach it: set database.direct_url)", poll)
	}
	if len(st.Waits) > 0 {
		w := st.Waits[0]
		c.Degraded = true
		what := "a lock held by"
		if w.Commit {
			what = "the commit to be seen of"
		}
		c.Detail += fmt.Sprintf(", waiting %s for %s %s", w.Waited.Round(time.Second), what, w)
		if n := len(st.Waits) - 1; n > 0 {
			c.Detail += fmt.Sprintf(" (and %d more)", n)
		}
	}
	return c
}
