package forwarder

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/millrace-io/millrace/internal/store"
)

// probeTimeout bounds the wait for the relay's own probe notification. A
// NOTIFY reaches a listener on a direct connection within milliseconds;
// one sent through a pooler in transaction mode never does.
const probeTimeout = 2 * time.Second

// notifier holds the relay's LISTEN connection: it wakes the forwarding
// loop (or the shard relays) on the outbox's notifications, the scheduler
// on the scheduled messages', and standbys when a leader releases its
// lease. A relay whose LISTEN connection receives nothing (its probe did
// not come back: a pooler in transaction mode between it and PostgreSQL)
// runs without one and polls.
type notifier struct {
	// session is the direct session the relay's leases are tied to; nil
	// when the relay polls.
	session *store.Session
	// lost is closed when the LISTEN connection ends; nil when polling.
	lost <-chan struct{}
	// released receives a signal when a relay of this outbox released its lease.
	released chan struct{}

	mu    sync.Mutex
	route func(shard int) // where the outbox's notifications go; nil drops them
	stop  func()
}

// listening says whether notifications arrive; otherwise the relay polls.
func (n *notifier) listening() bool { return n.lost != nil }

// setRoute sends the outbox's notifications to route (nil: nowhere).
func (n *notifier) setRoute(route func(shard int)) {
	n.mu.Lock()
	n.route = route
	n.mu.Unlock()
}

func (n *notifier) outbox(shard int) {
	n.mu.Lock()
	route := n.route
	n.mu.Unlock()
	if route != nil {
		route(shard)
	}
}

// close ends the LISTEN connection and waits for its goroutine.
func (n *notifier) close() { n.stop() }

// openNotifier LISTENs on a connection of the notification pool (the
// direct database URL, else the relay's pool) and checks with a probe
// NOTIFY, sent through the relay's pool, that notifications arrive. A
// connection whose server pid is not the one it started with goes through
// a pooler (PgBouncer answers the start with a key of its own): it does not
// LISTEN there, as a probe may come back by chance, on a server connection
// the pooler lends to the probe's sender. When notifications cannot arrive
// it returns a polling notifier and says why in the log and the relay's
// status. It fails only when the connection cannot be had or is not pgx's.
func (f *Forwarder) openNotifier(ctx context.Context) (*notifier, error) {
	n := &notifier{released: make(chan struct{}, 1), stop: func() {}}
	conn, err := f.listenDB.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("forwarder: notification connection: %w", err)
	}
	var pc *pgx.Conn
	if err := conn.Raw(func(dc any) error {
		// *stdlib.Conn, or a driver that wraps it and exposes the same method.
		sc, ok := dc.(interface{ Conn() *pgx.Conn })
		if !ok {
			return fmt.Errorf("%w, got %T", ErrNotPgx, dc)
		}
		pc = sc.Conn()
		return nil
	}); err != nil {
		discard(conn)
		return nil, err
	}
	session, err := store.CurrentSession(ctx, conn)
	if err == nil && uint32(session.PID) != pc.PgConn().PID() {
		// The server's pid is not the one the connection started with: a
		// pooler stands between, and a LISTEN would stay on a server
		// connection the pooler hands to other clients.
		discard(conn)
		f.pollInstead("the notification connection goes through a pooler")
		return n, nil
	}
	if err == nil {
		for _, ch := range []string{store.NotifyChannel, store.ScheduledNotifyChannel} {
			if _, err = pc.Exec(ctx, `LISTEN `+ch); err != nil {
				break
			}
		}
	}
	if err != nil {
		discard(conn)
		return nil, fmt.Errorf("forwarder: LISTEN: %w", err)
	}
	signal(f.scheduledWake) // messages scheduled while nobody listened
	lctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	lost, probed := make(chan struct{}), make(chan struct{}, 1)
	probe := f.tables.ProbePayload(f.instance)
	go func() {
		defer close(lost)
		defer discard(conn)
		f.receive(lctx, pc, n, probe, probed)
	}()
	n.stop = func() { cancel(); <-lost }
	if !f.probe(ctx, probe, probed, lost) {
		n.close()
		n.stop, n.lost = func() {}, nil
		f.pollInstead("the relay's probe notification did not come back")
		return n, nil
	}
	f.health.setPolling(false)
	n.session, n.lost = &session, lost
	return n, nil
}

// probe sends a NOTIFY with payload through the relay's pool and reports
// whether the LISTEN connection received it within probeTimeout.
func (f *Forwarder) probe(ctx context.Context, payload string, probed, lost <-chan struct{}) bool {
	if _, err := f.db.ExecContext(ctx, `SELECT pg_notify($1, $2)`, store.NotifyChannel, payload); err != nil {
		f.logger.Error("Could not send the relay's probe notification; polling", err, nil)
		return false
	}
	t := time.NewTimer(probeTimeout)
	defer t.Stop()
	select {
	case <-probed:
		return true
	case <-lost:
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

// pollInstead says, in the log and the relay's status, that notifications
// do not reach the relay, and why.
func (f *Forwarder) pollInstead(why string) {
	f.health.setPolling(true)
	f.logger.Info("Notifications do not reach the relay: it polls every relay.poll_interval; "+
		"set database.direct_url to a connection without a pooler for wake-ups at commit",
		watermill.LogFields{"why": why, "poll_interval": f.cfg.PollInterval.String()})
}

// receive dispatches the notifications pc receives until ctx ends or the
// connection fails.
func (f *Forwarder) receive(ctx context.Context, pc *pgx.Conn, n *notifier, probe string, probed chan<- struct{}) {
	released := f.tables.LeaseReleasedPayload()
	for {
		note, err := pc.WaitForNotification(ctx)
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, context.Canceled) {
				f.logger.Error("Lost the relay's LISTEN connection", err, nil)
			}
			return
		}
		switch {
		case note.Channel == store.ScheduledNotifyChannel:
			if note.Payload == f.tables.Schema {
				signal(f.scheduledWake)
			}
		case note.Payload == probe:
			signal(probed)
		case note.Payload == released:
			signal(n.released)
		default:
			if shard, ours := f.tables.NotifiedShard(note.Payload); ours {
				n.outbox(shard)
			}
		}
	}
}

// discard closes conn's underlying connection instead of returning it to the
// pool, ending its LISTEN.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return errBadConn })
	_ = conn.Close()
}
