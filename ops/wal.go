package ops

import (
	"context"
	"errors"

	"github.com/millrace-io/millrace/forwarder/wal"
)

// WALSlot is the replication slot of the relay with relay.source: wal, as
// pg_replication_slots shows it.
type WALSlot struct {
	// Name is the slot's name (relay.wal_slot, or its default).
	Name string `json:"slot"`
	// Exists is false when the slot does not exist (yet: the relay creates
	// it at start; or no longer: it was dropped).
	Exists bool `json:"exists"`
	// Active is true while a relay streams the slot.
	Active bool `json:"active"`
	// WALStatus is "reserved", "extended", "unreserved" or "lost": a lost
	// slot was invalidated (max_slot_wal_keep_size) and can never be read
	// again (see docs/WAL.md).
	WALStatus string `json:"wal_status,omitempty"`
	// RestartLSN is the oldest WAL the slot keeps; ConfirmedFlushLSN is
	// where the relay resumes (everything before it reached the broker).
	RestartLSN        string `json:"restart_lsn,omitempty"`
	ConfirmedFlushLSN string `json:"confirmed_flush_lsn,omitempty"`
	// RetainedBytes is the WAL the slot keeps on the server's disk
	// (the gauge millrace_relay_wal_retained_bytes).
	RetainedBytes int64 `json:"retained_bytes"`
}

// WALStatus reports the WAL relay's replication slot; a slot that does
// not exist is a WALSlot with Exists false, not an error.
func (c *Client) WALStatus(ctx context.Context) (WALSlot, error) {
	cfg := c.walConfig()
	st, err := wal.Status(ctx, cfg.URL, cfg.Slot)
	if errors.Is(err, wal.ErrNoSlot) {
		return WALSlot{Name: cfg.Slot}, nil
	}
	if err != nil {
		return WALSlot{Name: cfg.Slot}, err
	}
	return walSlot(st), nil
}

// CreateWALSlot creates the WAL relay's publication (when missing) and
// replication slot, after checking the server's and the role's
// requirements (wal.Check's errors, naming the setting or statement), and
// returns the new slot; an error wrapping wal.ErrSlotExists when it exists
// already. The slot holds the events committed from its creation on; the
// relay forwards what the outbox table holds from before when it starts.
// Creating a slot waits for the transactions running at that moment.
func (c *Client) CreateWALSlot(ctx context.Context) (WALSlot, error) {
	st, err := wal.CreateSlot(ctx, c.walConfig())
	if err != nil {
		return WALSlot{Name: c.walConfig().Slot}, err
	}
	return walSlot(st), nil
}

// DropWALSlot drops the WAL relay's replication slot, releasing the WAL it
// keeps: for a relay stopped for good, or a slot PostgreSQL invalidated.
// A relay streaming the slot refuses the drop (stop it first); an error
// wrapping wal.ErrNoSlot when the slot does not exist. A relay started
// again creates a new slot and forwards what the outbox table still holds.
func (c *Client) DropWALSlot(ctx context.Context) error {
	cfg := c.walConfig()
	return wal.DropSlot(ctx, cfg.URL, cfg.Slot)
}

// walConfig is the slot of c's outbox as its WAL relay names it.
func (c *Client) walConfig() wal.Config { return c.cfg.WALSlot() }

// walSlot converts a slot's state.
func walSlot(st wal.SlotStatus) WALSlot {
	return WALSlot{Name: st.Name, Exists: true, Active: st.Active, WALStatus: st.WALStatus,
		RestartLSN: st.RestartLSN.String(), ConfirmedFlushLSN: st.ConfirmedFlushLSN.String(), RetainedBytes: st.RetainedBytes}
}
