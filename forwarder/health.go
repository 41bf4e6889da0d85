package forwarder

import (
	"sync/atomic"
	"time"
)

// Role is what a relay is doing, as health checks report it.
type Role int32

// Roles of a relay.
const (
	// RoleStarting: Run has not reached the leader lock yet, or is waiting
	// to try again after losing it.
	RoleStarting Role = iota
	// RoleStandby: waiting for the leader lock another relay holds.
	RoleStandby
	// RoleActive: holding the leader lock and forwarding.
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
}

// health is the relay's live state, written by its loop and read by
// Status from any goroutine.
type health struct {
	role atomic.Int32
	tick atomic.Int64 // unix nanoseconds
}

func (h *health) set(r Role) {
	h.role.Store(int32(r))
	h.beat()
}

func (h *health) beat() { h.tick.Store(time.Now().UnixNano()) }

// Status reports the relay's role and when its loop last ticked. It is safe
// to call from any goroutine while Run runs.
func (f *Forwarder) Status() Status {
	return Status{Role: Role(f.health.role.Load()), LastTick: time.Unix(0, f.health.tick.Load())}
}
