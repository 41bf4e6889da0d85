package forwarder

import (
	"sync/atomic"
	"time"

	"github.com/millrace-io/millrace/internal/store"
)

// Role is what a relay is doing, as health checks report it.
type Role int32

// Roles of a relay.
const (
	// RoleStarting: Run has not asked for the lease yet, or is waiting to
	// try again after losing it.
	RoleStarting Role = iota
	// RoleStandby: waiting for the lease another relay holds.
	RoleStandby
	// RoleActive: holding the lease and forwarding.
	RoleActive
)

func (r Role) String() string {
	switch r {
	case RoleStandby:
		return "standby"
	case RoleActive:
		return "active"
	default:
		return "starting"
	}
}

// Status is a relay's health as of now.
type Status struct {
	// Role is what the relay is doing.
	Role Role
	// LastTick is when its loop last moved on: a batch done, a poll, a
	// notification, a retry after a failure. An active relay whose loop is
	// blocked (a statement that never returns) stops ticking.
	LastTick time.Time
	// Polling is true when notifications do not reach the relay (no direct
	// connection to PostgreSQL): it wakes every poll_interval instead of at
	// each commit.
	Polling bool
	// Waits are the transactions whose locks statements of this relay have
	// waited for past a second, and for a WAL relay those whose COMMIT it
	// has waited to see past a second, as last measured (every
	// backlog_interval).
	Waits []Wait
	// LastRenewal is when the relay last renewed its leases; zero while it
	// holds none.
	LastRenewal time.Time
}

// Wait is a statement of a relay waiting for a lock that another
// transaction holds, and that transaction (pid, application_name, state,
// age, and its query when the relay's role may read it).
type Wait = store.Wait

// health is the relay's live state, written by its loop and read by
// Status from any goroutine.
type health struct {
	role    atomic.Int32
	tick    atomic.Int64 // unix nanoseconds
	polling atomic.Bool
	waits   atomic.Pointer[[]Wait]
	renewed atomic.Int64 // unix nanoseconds; 0 while no lease is held
}

func (h *health) set(r Role) {
	h.role.Store(int32(r))
	h.beat()
}

func (h *health) beat() { h.tick.Store(time.Now().UnixNano()) }

func (h *health) setPolling(p bool) { h.polling.Store(p) }

func (h *health) setWaits(w []Wait) { h.waits.Store(&w) }

// setRenewed records a renewal of the relay's leases at t; the zero t says
// it holds none.
func (h *health) setRenewed(t time.Time) {
	if t.IsZero() {
		h.renewed.Store(0)
		return
	}
	h.renewed.Store(t.UnixNano())
}

// Status reports the relay's role and when its loop last ticked. It is safe
// to call from any goroutine while Run runs.
func (f *Forwarder) Status() Status {
	st := Status{Role: Role(f.health.role.Load()), LastTick: time.Unix(0, f.health.tick.Load()), Polling: f.health.polling.Load()}
	if w := f.health.waits.Load(); w != nil {
		st.Waits = *w
	}
	if r := f.health.renewed.Load(); r != 0 {
		st.LastRenewal = time.Unix(0, r)
	}
	return st
}
