package forwarder

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

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
// the NOTIFY of a newly scheduled one, and at most schedule_poll_interval.
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
	wake := make(chan struct{}, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { f.listenScheduled(ctx, wake) })

	retry := f.newBackoff()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-wake:
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

// listenScheduled LISTENs for newly scheduled messages on a connection of
// its own and signals wake for each notification naming this schema, and
// once after each (re)connection, which may have missed some.
func (f *Forwarder) listenScheduled(ctx context.Context, wake chan<- struct{}) {
	retry := f.newBackoff()
	for ctx.Err() == nil {
		err := f.listenScheduledOnce(ctx, func() { retry.Reset(); signal(wake) })
		if ctx.Err() != nil {
			return
		}
		wait := retry.NextBackOff()
		f.logger.Error("Lost the scheduled messages LISTEN connection; reconnecting", err, watermill.LogFields{"retry_in": wait.String()})
		if !sleep(ctx, wait) {
			return
		}
	}
}

// listenScheduledOnce holds one LISTEN connection until it fails or ctx
// ends, calling notified once LISTEN succeeded and for each notification.
func (f *Forwarder) listenScheduledOnce(ctx context.Context, notified func()) error {
	conn, err := f.db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("forwarder: scheduler connection: %w", err)
	}
	defer discard(conn)
	return conn.Raw(func(dc any) error {
		sc, ok := dc.(interface{ Conn() *pgx.Conn })
		if !ok {
			return fmt.Errorf("%w, got %T", ErrNotPgx, dc)
		}
		pc := sc.Conn()
		if _, err := pc.Exec(ctx, `LISTEN `+store.ScheduledNotifyChannel); err != nil {
			return fmt.Errorf("forwarder: LISTEN %s: %w", store.ScheduledNotifyChannel, err)
		}
		notified()
		for {
			n, err := pc.WaitForNotification(ctx)
			if err != nil {
				if errors.Is(err, context.Canceled) {
					return nil
				}
				return err
			}
			if n.Payload == f.tables.Schema {
				notified()
			}
		}
	})
}
