package forwarder

import (
	"context"
	"time"
)

// statsEvery bounds how often a busy relay counts its backlog; an idle relay
// never does (an empty batch already says nothing is pending), which keeps
// it at one query per poll interval.
const statsEvery = 5 * time.Second

func (f *Forwarder) recordIdle() {
	f.metrics.pending.Set(0)
	f.metrics.oldestAge.Set(0)
}

func (f *Forwarder) recordBatch(ctx context.Context, handled []outboxRow, read int) {
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
	if read < f.cfg.BatchSize && len(handled) == read {
		f.recordIdle()
		return
	}
	if now.Sub(f.lastStats) < statsEvery {
		return
	}
	f.lastStats = now
	pending, oldest, err := f.Pending(ctx)
	if err != nil {
		f.logger.Error("Could not measure the outbox backlog", err, nil)
		return
	}
	f.metrics.pending.Set(float64(pending))
	f.metrics.oldestAge.Set(oldest.Seconds())
}

// Pending counts the committed outbox rows this relay's group has not
// forwarded yet and the age of the oldest of them.
func (f *Forwarder) Pending(ctx context.Context) (rows int64, oldest time.Duration, err error) {
	st, err := f.tables.Status(ctx, f.db, f.cfg.ConsumerGroup)
	return st.Pending, st.OldestPendingAge, err
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
// has forwarded and that are older than olderThan, and returns how many.
func (f *Forwarder) DeleteForwarded(ctx context.Context, olderThan time.Duration, limit int) (int64, error) {
	return f.tables.DeleteForwarded(ctx, f.db, f.cfg.ConsumerGroup, olderThan, limit)
}
