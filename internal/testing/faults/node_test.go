package faults

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/bus"
)

// nodeEnv carries a node's spec, as JSON, to a child process: this test
// binary run again.
const nodeEnv = "MILLRACE_FAULTS_NODE"

// nodeRole is a node's child.Role.
const nodeRole = "faults-node"

// nodeSpec is what one node process runs: the relay, the consumer, or both,
// through bus.Run, as a service would.
type nodeSpec struct {
	Config  bus.Config
	Relay   bool
	Consume bool
	Topic   string
	Handler string
	// DependencyURL is called by the handler before its effect; a non-200
	// answer fails the attempt (a dependency outage).
	DependencyURL string
	// Probe gives the handler a dependency probe that calls DependencyURL.
	Probe bool
	// KillAfterEffect makes the node SIGKILL itself once its n-th event's
	// effect is committed, before the ack (0: never).
	KillAfterEffect int
	// FailFirstEvery fails the first attempt of every event whose payload's
	// n it divides (0: none) with a retryable error; the attempt is recorded
	// in the failed_attempts table outside its transaction, so the next one
	// succeeds, in whichever process it runs.
	FailFirstEvery int
	// RefuseUntilFixed refuses the event whose payload's n it is (0:
	// none) with a permanent error, so that it is poisoned, until the fixed
	// table has a row: a bug fixed before the replay.
	RefuseUntilFixed int
	// QueryExecMode, when set, is the default_query_exec_mode the node's
	// database.url gets (pgx's exec, simple_protocol, ...).
	QueryExecMode string
	// ReportEffects makes the node write an effectLine on stderr for every
	// message whose chain returned without error: its effect (or, for a
	// duplicate, the first one) is committed, in whichever database the
	// node's connection reached.
	ReportEffects bool
}

// effectLine starts the line a node with ReportEffects writes for each
// message whose effect is committed, followed by the event id.
const effectLine = "effect committed: "

// payload is the events' body. N == 0 marks a malformed event.
type payload struct {
	N int `json:"n"`
}

// runNode is the child process: it runs spec until SIGTERM and returns the
// exit code.
func runNode(raw string) int {
	var spec nodeSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "node: bad spec:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	dumpGoroutinesOnSignal()
	cfg := spec.Config
	cfg.Relay.Enabled = &spec.Relay
	if spec.QueryExecMode != "" {
		u, err := withQueryExecMode(cfg.Database.URL, spec.QueryExecMode)
		if err != nil {
			fmt.Fprintln(os.Stderr, "node:", err)
			return 2
		}
		cfg.Database.URL = u
	}
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		fmt.Fprintln(os.Stderr, "node:", err)
		return 1
	}
	defer db.Close()
	var opts []bus.Option
	if spec.KillAfterEffect > 0 {
		opts = append(opts, bus.WithRouterMiddleware(killAfterEffect(spec.KillAfterEffect)))
	}
	if spec.ReportEffects {
		opts = append(opts, bus.WithRouterMiddleware(reportEffects))
	}
	b, err := bus.Open(ctx, cfg, db, opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "node:", err)
		return 1
	}
	defer b.Close()
	if spec.Consume {
		var hopts []bus.HandleOption
		if spec.Probe {
			hopts = append(hopts, bus.WithDependencyProbe(func(ctx context.Context) error { return callDependency(ctx, spec.DependencyURL) }))
		}
		if err := b.Handle(spec.Topic, spec.Handler, effectHandler(spec, db, cfg.Database.Schema), hopts...); err != nil {
			fmt.Fprintln(os.Stderr, "node:", err)
			return 1
		}
	}
	if err := b.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "node:", err)
		return 1
	}
	return 0
}

// effectHandler writes one effects row per event in the inbox transaction.
// The table has no unique key: a second effect of an event shows as a
// second row.
func effectHandler(spec nodeSpec, db *sql.DB, schema string) bus.HandlerFunc {
	insert := `INSERT INTO "` + schema + `".effects (event_id, aggregate_id, version, pid) VALUES ($1, $2, $3, $4)`
	failed := `INSERT INTO "` + schema + `".failed_attempts (event_id) VALUES ($1) ON CONFLICT DO NOTHING`
	pid := os.Getpid()
	return func(ctx context.Context, ev bus.Event) error {
		var p payload
		if err := json.Unmarshal(ev.Payload, &p); err != nil || p.N == 0 {
			return bus.Permanent(fmt.Errorf("payload: not a counted event: %s", ev.Payload))
		}
		if spec.RefuseUntilFixed > 0 && p.N == spec.RefuseUntilFixed {
			if err := refuseUntilFixed(ctx, db, schema); err != nil {
				return err
			}
		}
		if spec.FailFirstEvery > 0 && p.N%spec.FailFirstEvery == 0 {
			res, err := db.ExecContext(ctx, failed, ev.ID)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n == 1 {
				return fmt.Errorf("the first attempt of event %s fails", ev.ID)
			}
		}
		if spec.DependencyURL != "" {
			if err := callDependency(ctx, spec.DependencyURL); err != nil {
				return err
			}
		}
		_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, insert, ev.ID, ev.AggregateID, ev.AggregateVersion, pid)
		return err
	}
}

// refuseUntilFixed is a permanent error until schema's fixed table has a
// row.
func refuseUntilFixed(ctx context.Context, db *sql.DB, schema string) error {
	var fixed bool
	if err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM "`+schema+`".fixed)`).Scan(&fixed); err != nil {
		return err
	}
	if !fixed {
		return bus.Permanent(errors.New("a bug refuses this event until it is fixed"))
	}
	return nil
}

var dependencyClient = &http.Client{Timeout: 2 * time.Second}

// callDependency fails unless url answers 200.
func callDependency(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := dependencyClient.Do(req)
	if err != nil {
		return fmt.Errorf("dependency: %w", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("dependency: %s", resp.Status)
	}
	return nil
}

// killAfterEffect SIGKILLs the process when the n-th message's chain has
// returned without error (its effect and inbox row committed) and before the
// router acks it.
func killAfterEffect(n int) message.HandlerMiddleware {
	var handled atomic.Int64
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && handled.Add(1) == int64(n) {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {}
			}
			return out, err
		}
	}
}

// reportEffects writes an effectLine on stderr for each message whose chain
// returned without error, after its transaction committed and before the
// router acks it.
func reportEffects(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil {
			fmt.Fprintln(os.Stderr, effectLine+msg.UUID)
		}
		return out, err
	}
}

// withQueryExecMode returns the PostgreSQL URL raw with
// default_query_exec_mode set to mode.
func withQueryExecMode(raw, mode string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("database.url: %w", err)
	}
	q := u.Query()
	q.Set("default_query_exec_mode", mode)
	u.RawQuery = q.Encode()
	return u.String(), nil
}
