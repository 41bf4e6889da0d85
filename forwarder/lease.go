package forwarder

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/internal/store"
)

// errLeadershipLost stops the forwarding loop when the relay's lease passed
// to another relay, expired, or lost the session it was tied to.
var errLeadershipLost = errors.New("forwarder: lost the lease on the outbox")

// standbyPoll is how often a standby asks for a lease: a leader's lease is
// free at once when its tied session ends, else lease_ttl after its last
// renewal, or when it is released (a NOTIFY wakes the standbys then).
func (f *Forwarder) standbyPoll() time.Duration { return min(f.cfg.PollInterval, f.cfg.LeaseTTL/5) }

// renewEvery is how often a leader renews its leases: three renewals fit in
// one lease_ttl, so that one slow statement does not cost the lease (at the
// default 10s, a renewal every 3.3s).
func (f *Forwarder) renewEvery() time.Duration { return f.cfg.LeaseTTL / 3 }

// lead waits for the lease of the whole outbox, then forwards until ctx
// ends, the lease is lost or the LISTEN connection breaks, and releases
// the lease.
func (f *Forwarder) lead(ctx context.Context, n *notifier) error {
	f.health.set(RoleStandby)
	if err := f.tables.PrepareCursor(ctx, f.db, f.cursor); err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	lease, pos, err := f.awaitLease(ctx, n)
	if err != nil || ctx.Err() != nil {
		return err
	}
	f.lease, f.pos, f.saved, f.savedAt = lease, pos, pos, time.Now()
	f.health.set(RoleActive)
	f.metrics.leader.Set(1)
	f.metrics.shardOwned.WithLabelValues("0").Set(1)
	defer func() { f.metrics.leader.Set(0); f.metrics.shardOwned.WithLabelValues("0").Set(0) }()
	f.logger.Info("Relay is active", watermill.LogFields{"fence": lease.Fence, "position": pos.String(), "listening": n.listening()})

	leadCtx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	wake := make(chan struct{}, 1)
	n.setRoute(func(int) { signal(wake) })
	defer n.setRoute(nil)
	keeperDone := make(chan struct{})
	go func() {
		defer close(keeperDone)
		f.keepLeases(leadCtx, func() []store.Lease { return []store.Lease{f.lease} }, func([]store.Lease) { stop(errLeadershipLost) })
	}()
	refresherDone := make(chan struct{})
	go func() { defer close(refresherDone); f.refreshBacklog(leadCtx) }()
	if f.wal != nil {
		err = f.streamWAL(leadCtx, n.lost)
	} else {
		err = f.forwardLoop(leadCtx, wake, n.lost)
	}
	stop(nil)
	<-keeperDone
	<-refresherDone
	f.dropAhead()
	if cause := context.Cause(leadCtx); errors.Is(cause, errLeadershipLost) {
		return cause
	}
	f.release(ctx, lease)
	return err
}

// awaitLease asks for the lease of f's cursor every standbyPoll, and at
// once when a leader releases one, until it gets it or ctx ends.
func (f *Forwarder) awaitLease(ctx context.Context, n *notifier) (store.Lease, store.Position, error) {
	t := time.NewTicker(f.standbyPoll())
	defer t.Stop()
	for {
		lease, pos, ok, err := f.tables.AcquireLease(ctx, f.db, f.cursor, f.instance, f.cfg.LeaseTTL, n.session)
		switch {
		case err != nil:
			return store.Lease{}, store.Position{}, fmt.Errorf("forwarder: %w", err)
		case ok:
			return lease, pos, nil
		}
		f.health.beat()
		select {
		case <-ctx.Done():
			return store.Lease{}, store.Position{}, nil
		case <-n.lost:
			return store.Lease{}, store.Position{}, fmt.Errorf("%w: the LISTEN connection ended", errLeadershipLost)
		case <-n.released:
		case <-t.C:
		}
	}
}

// keepLeases renews the leases held() returns every renewEvery until ctx
// ends, and calls lost with those another relay took, or with all of them
// once lease_ttl has passed since the last renewal that succeeded (the
// database unreachable: the leases have expired).
func (f *Forwarder) keepLeases(ctx context.Context, held func() []store.Lease, lost func([]store.Lease)) {
	t := time.NewTicker(f.renewEvery())
	defer t.Stop()
	renewed := time.Now()
	f.health.setRenewed(renewed)
	defer f.health.setRenewed(time.Time{})
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		leases := held()
		began := time.Now()
		gone, err := f.tables.RenewLeases(ctx, f.db, leases, f.cfg.LeaseTTL)
		switch {
		case err == nil:
			renewed = began
			f.health.setRenewed(renewed)
			if len(gone) > 0 {
				f.logger.Info("Relay lost a lease to another relay", watermill.LogFields{"leases": len(gone)})
				lost(gone)
			}
		case ctx.Err() != nil:
			return
		case time.Since(renewed) >= f.cfg.LeaseTTL:
			f.logger.Error("Relay could not renew its leases within relay.lease_ttl; they have expired", err, nil)
			lost(leases)
		default:
			f.logger.Error("Relay could not renew its leases; retrying", err, nil)
		}
	}
}

// release gives lease up so that a standby takes over at once, within
// shutdown_timeout even when ctx has ended.
func (f *Forwarder) release(ctx context.Context, lease store.Lease) {
	bye, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.cfg.ShutdownTimeout)
	defer cancel()
	if err := f.tables.ReleaseLease(bye, f.db, lease); err != nil {
		f.logger.Error("Relay could not release its lease; a standby takes over once it expires", err, nil)
	}
}
