package middleware

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/fault"
)

// errTxEnded explains a handler that ended the chain's transaction itself.
var errTxEnded = errors.New("the handler committed or rolled back the transaction of middleware.Tx itself; " +
	"leave that to millrace, which commits after the handler returns nil")

// transaction is the inbox stage. In one database transaction it inserts
// (consumer_group, event_id) into the inbox first, so that a concurrent
// duplicate waits on the row lock and then sees the row; checks the ordering
// guard; runs the handler with the transaction in its context (Tx); and
// commits. The message is acked only after that commit. A duplicate is acked
// without calling the handler; any error rolls everything back, the inbox
// row included, so the message can be tried again.
//
// The transaction is begun on the attempt's context, which ends at
// handler_timeout. An attempt abandoned then can never commit afterwards:
// database/sql rolls the transaction back when its context ends, and Commit
// checks that context before it marks the transaction done, so a Commit
// called after the deadline fails without sending COMMIT. Only a COMMIT
// sent before the deadline can still land: pgx cancels it and closes the
// connection at the deadline, but the server may have carried it out
// already, or be past the point where a cancel stops it (a wait for a
// synchronous standby). Its inbox row then makes the retry a duplicate,
// acked without calling the handler: the next attempt's insert waits on
// that row's lock until the server has decided.
func (c *Chain) transaction(next step) step {
	return func(m *inflight) error {
		ctx := m.msg.Context()
		a := m.a
		tx, err := c.stack.begin(ctx)
		if err != nil {
			return ownStatement(fmt.Errorf("inbox: begin transaction: %w", err))
		}
		done := false
		defer func() {
			if !done {
				_ = tx.Rollback()
			}
		}()
		r := c.step(m, tx, next, false)
		switch {
		case r.err != nil:
			if r.byHandler && IsRetryable(r.err) {
				// Did the handler fail because the database went away? Its
				// transaction answers unless the connection is gone.
				if _, probe := tx.ExecContext(ctx, "SELECT 1"); unreachable(probe) {
					return &unavailableError{err: r.err}
				}
			}
			return r.err
		case r.outcome == OutcomeDuplicate:
			a.outcome = OutcomeDuplicate
			return nil
		case r.outcome == OutcomeStale:
			// Keep the inbox row, so a redelivery is a plain duplicate.
			done = true
			if err := tx.Commit(); err != nil {
				return fmt.Errorf("ordering guard: commit: %w", err)
			}
			a.outcome = OutcomeStale
			return nil
		}
		done = true
		if err := tx.Commit(); err != nil {
			return commitError(ctx, err)
		}
		a.outcome = OutcomeOK
		return nil
	}
}

// commitError classifies a failed COMMIT of the inbox transaction begun on
// ctx.
func commitError(ctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil:
		// handler_timeout passed before or during the commit (see
		// transaction): not committed, or a COMMIT already sent lands and
		// the retry is a duplicate.
		return fmt.Errorf("inbox: commit failed, handler_timeout passed: %w", err)
	case errors.Is(err, sql.ErrTxDone):
		return fault.Permanent(errTxEnded)
	default:
		return ownStatement(fmt.Errorf("inbox: commit: %w", err))
	}
}

// stepResult is what one message did in its inbox transaction.
type stepResult struct {
	// outcome is OutcomeOK, OutcomeDuplicate (the handler was not called)
	// or OutcomeStale (the ordering guard skipped the handler) when err is nil.
	outcome string
	err     error
	// byHandler says err is the handler's, not one of the inbox statements'.
	byHandler bool
}

// step is one message's part of an inbox transaction tx: the inbox insert
// first, so that a concurrent duplicate waits on the row lock and then sees
// the row (unless inboxed: its batch inserted it already); the ordering
// guard; the rest of the chain (next: the handler) with tx as m's
// transaction (Tx). It neither commits nor rolls back.
func (c *Chain) step(m *inflight, tx Transaction, next step, inboxed bool) stepResult {
	msg := m.msg
	ctx := msg.Context()
	a := m.a
	group, tables := c.spec.ConsumerGroup, c.stack.tables
	if *c.cfg.Inbox.Enabled && !inboxed {
		first, err := tables.MarkProcessed(ctx, tx, group, a.eventID)
		if err != nil {
			return stepResult{err: ownStatement(err)}
		}
		if !first {
			return stepResult{outcome: OutcomeDuplicate}
		}
	}
	if *c.cfg.OrderingGuard {
		version, _ := aggregateVersion(msg) // checked by the validate stage
		aggregateID := msg.Metadata.Get(envelope.AggregateIDKey)
		if version > 0 && aggregateID != "" {
			newer, err := tables.ApplyVersion(ctx, tx, group, msg.Metadata.Get(envelope.AggregateTypeKey), aggregateID, version, a.eventID)
			if err != nil {
				return stepResult{err: err}
			}
			if !newer {
				// An equal or newer version was applied: keep the inbox
				// row and skip the handler.
				return stepResult{outcome: OutcomeStale}
			}
		}
	}
	m.tx = tx
	err := next(m)
	m.tx = nil
	if err != nil {
		return stepResult{err: err, byHandler: true}
	}
	return stepResult{outcome: OutcomeOK}
}

// ownStatement classifies a failure of one of the inbox transaction's own
// statements: unreachable database or not.
func ownStatement(err error) error {
	if unreachable(err) {
		return &unavailableError{err: err}
	}
	return err
}

// PruneInbox deletes the inbox rows older than inbox.retention, in batches
// of inbox.cleanup_batch, and refreshes the millrace_inbox_rows gauge.
func (s *Stack) PruneInbox(ctx context.Context) (int64, error) {
	if s.db == nil {
		return 0, errors.New("millrace consumer: prune inbox: Deps.DB is nil")
	}
	n, err := s.tables.PruneInbox(ctx, s.db, s.cfg.Inbox.Retention, "", s.cfg.Inbox.CleanupBatch)
	s.metrics.pruned.Add(float64(n))
	if err != nil {
		return n, err
	}
	return n, s.RefreshInboxRows(ctx)
}

// RefreshInboxRows counts the inbox rows of each consumer group into the
// millrace_inbox_rows gauge; the groups of this Stack's handlers with the
// inbox on are there from the first count, at 0 while they have no rows.
func (s *Stack) RefreshInboxRows(ctx context.Context) error {
	if s.db == nil {
		return errors.New("millrace consumer: count inbox rows: Deps.DB is nil")
	}
	counts, err := s.tables.InboxRows(ctx, s.db)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for group := range s.groups {
		if _, ok := counts[group]; !ok {
			counts[group] = 0
		}
	}
	for group := range s.inboxGroups {
		if _, ok := counts[group]; !ok {
			s.metrics.inboxRows.DeleteLabelValues(group)
		}
	}
	for group, count := range counts {
		s.metrics.inboxRows.WithLabelValues(group).Set(float64(count))
	}
	s.inboxGroups = counts
	return nil
}

// RunRetention prunes the inbox now and then every inbox.cleanup_interval
// until ctx ends; it returns ctx's error. A failed run is logged and tried
// again at the next interval. Run it in one goroutine per service (several
// instances running it at once is safe, only wasteful).
func (s *Stack) RunRetention(ctx context.Context) error {
	t := time.NewTicker(s.cfg.Inbox.CleanupInterval)
	defer t.Stop()
	for {
		n, err := s.PruneInbox(ctx)
		if err != nil && ctx.Err() == nil {
			s.logger.Error("Inbox retention run failed", err, nil)
		} else if n > 0 {
			s.logger.Info("Inbox rows pruned", watermill.LogFields{"rows": n, "retention": s.cfg.Inbox.Retention.String()})
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
