package forwarder

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/internal/store"
)

// minScheduleWait is the shortest sleep of the scheduler when nothing was
// moved: messages due already but held by another relay's move (FOR UPDATE
// SKIP LOCKED) are left to it for that long instead of being asked for in a
// busy loop.
const minScheduleWait = 10 * time.Millisecond

// schedule moves due scheduled messages into the outbox until ctx ends.
// Every relay runs it, active or standby: the move skips the rows another
// relay is moving. It sleeps until the next message is due, woken early by
// the NOTIFY of a newly scheduled one (the relay's notifier signals
// scheduledWake), and at most schedule_poll_interval, or poll_interval
// while notifications do not reach the relay.
func (f *Forwarder) schedule(ctx context.Context) {
	missing, err := store.Missing(ctx, f.db, f.tables.ScheduledTable())
	if err != nil && ctx.Err() == nil {
		f.logger.Error("Could not look up the scheduled messages table", err, nil)
	}
	if missing != "" {
		f.logger.Info("Scheduled messages are off until the relay restarts: their table does not exist (run `millrace migrate`)",
			watermill.LogFields{"table": missing})
		return
	}
	retry := f.newBackoff()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.scheduledWake:
		case <-timer.C:
		}
		wait, err := f.moveDue(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			wait = retry.NextBackOff()
			f.logger.Error("Could not move due scheduled messages into the outbox; retrying", err, watermill.LogFields{"retry_in": wait.String()})
		} else {
			retry.Reset()
		}
		if f.health.polling.Load() {
			wait = min(wait, f.cfg.PollInterval)
		}
		timer.Reset(wait)
	}
}

// moveDue moves every due message, batch_size per transaction, and returns
// how long to sleep.
func (f *Forwarder) moveDue(ctx context.Context) (time.Duration, error) {
	for {
		moved, next, ok, err := f.tables.MoveDue(ctx, f.db, f.cfg.BatchSize)
		if moved > 0 {
			f.metrics.scheduledMoved.Add(float64(moved))
			if f.afterScheduledMove != nil {
				f.afterScheduledMove(moved)
			}
		}
		switch {
		case err != nil:
			return 0, err
		case moved == f.cfg.BatchSize:
			continue
		case !ok:
			return f.cfg.SchedulePollInterval, nil
		default:
			return min(max(next, minScheduleWait), f.cfg.SchedulePollInterval), nil
		}
	}
}
