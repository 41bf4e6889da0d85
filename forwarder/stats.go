package forwarder

import (
	"context"
	"sync"
	"time"

	"github.com/millrace-io/millrace/internal/store"
)

// backlog is what the pending-rows and oldest-age gauges last showed and
// when it was measured. Two writers set them: the batch loop after a read
// that found nothing pending, and the refresher's count on its own timer;
// the later measurement wins.
type backlog struct {
	mu         sync.Mutex
	measuredAt time.Time // when the shown values were measured (the query's start)
	// idleAt is when the last read found nothing pending; zero once a read
	// found rows or failed, until a read finds none again.
	idleAt time.Time
}

// setBacklog shows pending and oldest, measured at at, unless a later measurement
// is already shown.
func (f *Forwarder) setBacklog(at time.Time, pending int64, oldest time.Duration) {
	f.backlog.mu.Lock()
	defer f.backlog.mu.Unlock()
	if at.Before(f.backlog.measuredAt) {
		return
	}
	f.backlog.measuredAt = at
	f.metrics.pending.Set(float64(pending))
	f.metrics.oldestAge.Set(oldest.Seconds())
}

// recordRead notes what the batch read that began at at found. A read that
// found nothing pending is a measurement of zero; anything else leaves the
// count to the refresher.
func (f *Forwarder) recordRead(at time.Time, rows int, err error) {
	if err == nil && rows == 0 {
		f.setBacklog(at, 0, 0)
		f.backlog.mu.Lock()
		f.backlog.idleAt = at
		f.backlog.mu.Unlock()
		return
	}
	f.backlog.mu.Lock()
	f.backlog.idleAt = time.Time{}
	f.backlog.mu.Unlock()
}

// recentlyIdle says whether the last read found nothing pending less than
// backlog_interval ago, so that counting again would only repeat it.
func (f *Forwarder) recentlyIdle(now time.Time) bool {
	f.backlog.mu.Lock()
	defer f.backlog.mu.Unlock()
	return !f.backlog.idleAt.IsZero() && now.Sub(f.backlog.idleAt) < f.cfg.BacklogInterval
}

// refreshBacklog counts the backlog in the database at once and then every
// backlog_interval until ctx ends, whatever the batch loop is doing (a
// failing broker, a publish that hangs), so the gauges rise during an
// outage.
func (f *Forwarder) refreshBacklog(ctx context.Context) {
	t := time.NewTicker(f.cfg.BacklogInterval)
	defer t.Stop()
	for {
		if now := time.Now(); !f.recentlyIdle(now) {
			pending, oldest, err := f.Pending(ctx)
			switch {
			case err == nil:
				f.setBacklog(now, pending, oldest)
			case ctx.Err() == nil:
				f.logger.Error("Could not measure the outbox backlog", err, nil)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (f *Forwarder) recordBatch(handled []outboxRow) {
	now := time.Now()
	f.metrics.batches.Inc()
	forwarded := 0
	for _, r := range handled {
		if r.quarantine != "" {
			continue
		}
		forwarded++
		if !r.occurred.IsZero() {
			f.metrics.commitToPublish.Observe(now.Sub(r.occurred).Seconds())
		}
	}
	f.metrics.forwarded.Add(float64(forwarded))
}

// Pending counts the committed outbox rows this relay's group has not
// forwarded yet and the age of the oldest of them, as `millrace outbox
// status` counts them; with relay.shards > 1, over every shard.
func (f *Forwarder) Pending(ctx context.Context) (rows int64, oldest time.Duration, err error) {
	for _, c := range f.cursors() {
		n, age, err := f.tables.Backlog(ctx, f.db, c)
		if err != nil {
			return 0, 0, err
		}
		rows, oldest = rows+n, max(oldest, age)
	}
	return rows, oldest, nil
}

// cursors are the cursors f reads: its own, or, for an instance with
// relay.shards > 1, every shard's.
func (f *Forwarder) cursors() []store.Cursor {
	if f.cursor.Shards > 1 {
		return []store.Cursor{f.cursor}
	}
	return store.RelayCursors(f.cfg.ConsumerGroup, f.cfg.OutboxShards())
}

// cleanup deletes forwarded rows older than the retention in bounded
// batches, so no DELETE holds a long transaction or bloats the WAL at once.
func (f *Forwarder) cleanup(ctx context.Context) {
	total := int64(0)
	for ctx.Err() == nil {
		n, err := f.DeleteForwarded(ctx, *f.cfg.Retention, f.cfg.CleanupBatch)
		if err != nil {
			f.logger.Error("Outbox cleanup failed", err, nil)
			return
		}
		total += n
		f.metrics.deleted.Add(float64(n))
		if n < int64(f.cfg.CleanupBatch) {
			break
		}
	}
	if total > 0 {
		f.logger.Debug("Outbox cleanup", map[string]any{"deleted": total})
	}
}

// DeleteForwarded deletes up to limit outbox rows that this relay's group
// has forwarded and that are older than olderThan (per shard, with
// relay.shards > 1), and returns how many.
func (f *Forwarder) DeleteForwarded(ctx context.Context, olderThan time.Duration, limit int) (int64, error) {
	total := int64(0)
	for _, c := range f.cursors() {
		n, err := f.tables.DeleteForwarded(ctx, f.db, c, olderThan, limit)
		if err != nil {
			return total, err
		}
		total += n
	}
	return total, nil
}
