package forwarder

import (
	"context"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/internal/store"
)

// watchWaits looks, every backlog_interval while the relay's loop or its
// lease renewals are late, for statements of this relay that wait for a
// lock another transaction holds (an operator's SELECT FOR UPDATE on the
// cursors, a migration's lock on the outbox), and reports each such
// transaction: pid, application_name, state, age and query in
// millrace_relay_blocker_age_seconds and a log line, the longest wait in
// millrace_relay_blocked_seconds, and the list in Status, which readiness
// shows as degraded. The table relay waits for no transaction's commit;
// the WAL relay waits until the commits it streamed are seen, and the
// sessions whose COMMIT waits for a synchronous standby are reported the
// same way. A relay that keeps moving makes no such query.
func (f *Forwarder) watchWaits(ctx context.Context) {
	t := time.NewTicker(f.cfg.BacklogInterval)
	defer t.Stop()
	reported := map[int32]bool{}
	for {
		var waits []Wait
		var err error
		if f.late(time.Now()) {
			waits, err = f.tables.RelayWaits(ctx, f.db, f.wal != nil)
		}
		if err != nil && ctx.Err() == nil {
			f.logger.Error("Could not look up what the relay waits on", err, nil)
		}
		if err == nil {
			reported = f.reportWaits(waits, reported)
		}
		select {
		case <-ctx.Done():
			f.health.setWaits(nil)
			return
		case <-t.C:
		}
	}
}

// reportWaits shows waits in the metrics and Status, logs each blocking
// session once, and returns the sessions reported now.
func (f *Forwarder) reportWaits(waits []Wait, before map[int32]bool) map[int32]bool {
	f.health.setWaits(waits)
	f.metrics.blockers.Reset()
	longest := time.Duration(0)
	now := map[int32]bool{}
	for _, w := range waits {
		longest = max(longest, w.Waited)
		f.metrics.blockers.WithLabelValues(strconv.Itoa(int(w.PID)), w.ApplicationName, w.State).Set(w.Age.Seconds())
		now[w.PID] = true
		switch {
		case before[w.PID]:
		case w.Commit:
			f.logger.Info("Relay waits until a transaction's commit is seen: its COMMIT waits for a synchronous standby "+
				"(see synchronous_standby_names)", watermill.LogFields{"waited": w.Waited.Round(time.Millisecond).String(), "blocking": w.String()})
		default:
			f.logger.Info("Relay waits for a lock another transaction holds", watermill.LogFields{
				"waited": w.Waited.Round(time.Millisecond).String(), "blocking": w.String()})
		}
	}
	f.metrics.blocked.Set(longest.Seconds())
	return now
}

// late says whether the relay's loop or its lease renewals are behind by
// more than store.WaitReported at now: a statement may be waiting.
func (f *Forwarder) late(now time.Time) bool {
	st := f.Status()
	loop := now.Sub(st.LastTick) > f.cfg.PollInterval+store.WaitReported
	renewal := !st.LastRenewal.IsZero() && now.Sub(st.LastRenewal) > f.renewEvery()+store.WaitReported
	return loop || renewal
}
