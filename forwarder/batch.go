package forwarder

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
)

// outboxRow is one row of the outbox as the batch query returns it, and what
// became of it.
type outboxRow struct {
	row      store.OutboxRow
	out      adapters.Outgoing
	occurred time.Time
	// quarantine is why the row can never be published; empty for a good row.
	quarantine string
}

// forwardBatch reads one batch (a single statement: the relay holds no
// transaction while the broker confirms), publishes it, and records the
// position after the longest prefix of rows the broker confirmed (or that
// were quarantined), fenced by the relay's lease. It returns how many rows
// it handled, and an error when it stopped at a retryable failure, or
// store.ErrLeaseLost when another relay has taken the lease.
func (f *Forwarder) forwardBatch(ctx context.Context) (handled int, err error) {
	work, release := f.graceContext(ctx)
	defer release()

	began := time.Now()
	b, rows, ok := f.takeAhead()
	if !ok {
		b, err = f.tables.ReadBatch(work, f.db, f.cursor, f.pos, f.cfg.BatchSize)
		rows = f.unwrap(b.Rows)
	}
	f.recordRead(began, len(rows), err)
	if err != nil {
		return 0, err
	}
	whole := f.cursor.Shards <= 1
	rows, foreign := f.ownRows(rows)
	if len(rows) == 0 && foreign != nil {
		return 0, foreign
	}
	if len(rows) == 0 {
		// Nothing to forward, but pending transactions may have ended.
		return 0, f.advance(work, b, 0, whole, nil)
	}
	if len(rows) == f.cfg.BatchSize {
		// A full batch: more is likely pending, so read it while this one
		// is published and acked.
		f.readAhead(ctx, f.pos.Advance(b, len(rows), whole))
	}
	confirmed, publishErr := f.publish(work, rows)
	if confirmed == 0 {
		return 0, cmp.Or(publishErr, foreign)
	}
	if err := f.advance(work, b, confirmed, whole, rows[:confirmed]); err != nil {
		return 0, err
	}
	f.recordBatch(rows[:confirmed])
	return confirmed, cmp.Or(publishErr, foreign)
}

// ownRows returns the rows before the first one a service of another
// broker.kind wrote, and an error naming both kinds when there is one:
// that row and the rows after it (in order) wait for a relay of its kind.
func (f *Forwarder) ownRows(rows []outboxRow) ([]outboxRow, error) {
	if f.kind == "" {
		return rows, nil
	}
	for i, r := range rows {
		if other := store.ForeignBroker(r.row.Metadata, f.stamp); other != "" {
			err := &store.BrokerChangeError{Recorded: other, Wanted: f.kind, Offset: r.row.Offset}
			return rows[:i], fmt.Errorf("broker.kind: %w; %s", err, switchBrokers)
		}
	}
	return rows, nil
}

// positionEvery is how often at most the relay records its position while
// rows flow. Each record is a new version of the cursor row, and while a
// transaction stays open anywhere on the server vacuum can remove none of
// them, so that each UPDATE walks every version since (at one record per
// batch of a 200/s trickle, 720,000 after an hour). Recorded at most ten
// times a second, a crash sends again at most the last 100 ms of rows (the
// consumer's inbox removes the duplicates).
const positionEvery = 100 * time.Millisecond

// advance moves the relay's position past the first forwarded rows of b
// (handled, of which some may be for the quarantine). Rows to quarantine
// are moved aside and the position recorded at once, in one transaction;
// otherwise the position is recorded when positionEvery has passed since
// the last record, and else left to flush.
func (f *Forwarder) advance(ctx context.Context, b store.Batch, forwarded int, whole bool, handled []outboxRow) error {
	next := f.pos.Advance(b, forwarded, whole)
	if next.Equal(f.pos) {
		return nil
	}
	f.pos = next
	var quarantined []outboxRow
	for _, r := range handled {
		if r.quarantine != "" {
			quarantined = append(quarantined, r)
		}
	}
	if len(quarantined) == 0 {
		if time.Since(f.savedAt) < positionEvery {
			return nil // flush records it
		}
		return f.flush(ctx)
	}
	err := f.inAck(ctx, func(ctx context.Context, tx *sql.Tx) error {
		for _, r := range quarantined {
			if err := f.quarantineRow(ctx, tx, r); err != nil {
				return err
			}
		}
		return f.tables.SavePosition(ctx, tx, f.lease, f.saved, f.pos)
	})
	if err != nil {
		return err
	}
	f.saved, f.savedAt = f.pos, time.Now()
	for _, r := range quarantined {
		f.reportQuarantined(r)
	}
	return nil
}

// inAck runs fn in a transaction of its own, bounded like every record
// of the relay (recordContext), and commits it.
func (f *Forwarder) inAck(ctx context.Context, fn func(context.Context, *sql.Tx) error) error {
	ctx, cancel := f.recordContext(ctx)
	defer cancel()
	tx, err := f.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin the ack: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	if err := fn(ctx, tx); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit the ack: %w", err)
	}
	return nil
}

// flush records the relay's position, if it moved since the last record:
// fenced by the lease and only over that record (store.SavePosition).
func (f *Forwarder) flush(ctx context.Context) error {
	if f.pos.Equal(f.saved) {
		return nil
	}
	ctx, cancel := f.recordContext(ctx)
	defer cancel()
	if err := f.tables.SavePosition(ctx, f.db, f.lease, f.saved, f.pos); err != nil {
		return err
	}
	f.saved, f.savedAt = f.pos, time.Now()
	return nil
}

// recordContext is the context a position record runs in: not cancelled by
// a stop, bounded by shutdown_timeout. A record cancelled halfway may commit
// on the server while the relay sees "context canceled", and the relay's
// next record, over the one it believes current, is then refused.
func (f *Forwarder) recordContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), f.cfg.ShutdownTimeout)
}

// unwrap unwraps each row's forwarder envelope; a row whose envelope is
// unreadable is marked for the quarantine.
func (f *Forwarder) unwrap(read []store.OutboxRow) []outboxRow {
	rows := make([]outboxRow, len(read))
	for i, row := range read {
		r := outboxRow{row: row}
		topic, msg, err := envelope.Unwrap(row.Payload)
		switch {
		case err != nil:
			r.quarantine = err.Error()
		default:
			r.out = adapters.Outgoing{Topic: topic, Msg: msg}
			if at, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(envelope.OccurredAtKey)); err == nil {
				r.occurred = at
			}
		}
		rows[i] = r
	}
	return rows
}

// ahead is the next batch, read while the batch in flight is published,
// from the position that batch leads to once all of it is handled.
type ahead struct {
	after store.Position
	done  chan struct{} // closed once batch, rows and err are set
	batch store.Batch
	rows  []outboxRow
	err   error
}

// readAhead starts reading the batch after pos.
func (f *Forwarder) readAhead(ctx context.Context, after store.Position) {
	a := &ahead{after: after, done: make(chan struct{})}
	f.ahead = a
	go func() {
		defer close(a.done)
		a.batch, a.err = f.tables.ReadBatch(ctx, f.db, f.cursor, after, f.cfg.BatchSize)
		if a.err == nil {
			a.rows = f.unwrap(a.batch.Rows)
		}
	}()
}

// takeAhead returns the batch read ahead if it was read after the relay's
// position now: only then is it the batch ReadBatch would read (under a
// snapshot no newer than now's, which Advance allows: a position's
// invariant holds at every later time). Otherwise (a partial or failed
// batch before it, a failed read) ok is false and the caller reads again.
func (f *Forwarder) takeAhead() (b store.Batch, rows []outboxRow, ok bool) {
	a := f.ahead
	if a == nil {
		return store.Batch{}, nil, false
	}
	f.ahead = nil
	<-a.done
	if a.err != nil || !a.after.Equal(f.pos) {
		return store.Batch{}, nil, false
	}
	return a.batch, a.rows, true
}

// dropAhead waits for a read ahead to end and forgets it.
func (f *Forwarder) dropAhead() {
	if f.ahead != nil {
		<-f.ahead.done
		f.ahead = nil
	}
}

// publish sends the good rows in slices of max_in_flight and returns how
// many leading rows are done (confirmed or to be quarantined), with the
// retryable error that stopped it, if any.
func (f *Forwarder) publish(ctx context.Context, rows []outboxRow) (int, error) {
	done := 0
	for done < len(rows) {
		// Collect the next slice of publishable rows, passing over rows that
		// are already marked for quarantine.
		var slice []int
		for i := done; i < len(rows) && len(slice) < f.slice; i++ {
			if rows[i].quarantine == "" {
				slice = append(slice, i)
			}
		}
		if len(slice) == 0 {
			return len(rows), nil
		}
		if err := f.provision(ctx, rows, slice); err != nil {
			return done, err
		}
		if slice = publishable(rows, slice); len(slice) == 0 {
			continue // every row of the slice was quarantined by provisioning
		}
		if f.limiter != nil {
			if err := f.limiter.WaitN(ctx, len(slice)); err != nil {
				return done, err
			}
		}
		out := make([]adapters.Outgoing, len(slice))
		for j, i := range slice {
			out[j] = rows[i].out
		}
		if f.beforePublish != nil {
			f.beforePublish(len(out))
		}
		endSpans := f.tracing.start(ctx, out)
		err := f.broker.PublishBatch(ctx, out)
		endSpans(err)
		if f.afterPublish != nil {
			f.afterPublish(len(out))
		}
		if err == nil {
			done = slice[len(slice)-1] + 1
			continue
		}
		var be *adapters.BatchError
		if !errors.As(err, &be) || len(be.Errs) != len(slice) {
			return done, fmt.Errorf("publish %d messages: %w", len(slice), err)
		}
		for j, i := range slice {
			switch e := be.Errs[j]; {
			case e == nil:
			case adapters.IsPermanent(e):
				rows[i].quarantine = e.Error()
				f.metrics.publishErrors.WithLabelValues(errorClassPermanent).Inc()
			default:
				return i, fmt.Errorf("publish message %s to %s: %w", rows[i].out.Msg.UUID, rows[i].out.Topic, e)
			}
		}
		done = slice[len(slice)-1] + 1
	}
	return done, nil
}

// provision makes sure every destination topic of the slice exists, once per
// topic per relay process. A topic the broker refuses for good (its existing
// topology conflicts with the configured one) sends that topic's rows to the
// quarantine instead of stalling the relay; other failures are retried.
func (f *Forwarder) provision(ctx context.Context, rows []outboxRow, slice []int) error {
	refused := map[string]error{}
	for _, i := range slice {
		topic := rows[i].out.Topic
		if f.provisioned[topic] {
			continue
		}
		err, seen := refused[topic]
		if !seen {
			err = f.broker.Provision(ctx, topic)
			switch {
			case err == nil:
				f.provisioned[topic] = true
				continue
			case !adapters.IsPermanent(err):
				return fmt.Errorf("provision topic %s: %w", topic, err)
			}
			refused[topic] = err
		}
		rows[i].quarantine = fmt.Sprintf("provision topic %s: %v", topic, err)
		f.metrics.publishErrors.WithLabelValues(errorClassPermanent).Inc()
	}
	return nil
}

// publishable keeps the rows of slice that are not marked for quarantine.
func publishable(rows []outboxRow, slice []int) []int {
	kept := slice[:0]
	for _, i := range slice {
		if rows[i].quarantine == "" {
			kept = append(kept, i)
		}
	}
	return kept
}

// quarantineRow moves r aside in the ack transaction tx.
func (f *Forwarder) quarantineRow(ctx context.Context, tx *sql.Tx, r outboxRow) error {
	var topic, eventID string
	if r.out.Msg != nil {
		topic, eventID = r.out.Topic, r.out.Msg.UUID
	}
	return f.tables.Quarantine(ctx, tx, r.row, topic, eventID, r.quarantine)
}

// reportQuarantined counts and logs r once its move to the quarantine
// was committed.
func (f *Forwarder) reportQuarantined(r outboxRow) {
	var topic, eventID string
	if r.out.Msg != nil {
		topic, eventID = r.out.Topic, r.out.Msg.UUID
	} else {
		f.metrics.publishErrors.WithLabelValues(errorClassCorrupt).Inc()
	}
	f.metrics.quarantined.Inc()
	f.logger.Error("Outbox row moved to the relay quarantine", errors.New(r.quarantine), watermill.LogFields{
		"outbox_offset": r.row.Offset, "event_id": eventID, "topic": topic,
	})
}

// graceContext is the context a batch runs in: it outlives ctx by
// shutdown_timeout, so that a stopping relay acks what the broker already
// confirmed. release frees it.
func (f *Forwarder) graceContext(ctx context.Context) (work context.Context, release func()) {
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(f.cfg.ShutdownTimeout, cancelWork)
		context.AfterFunc(work, func() { t.Stop() })
	})
	return work, func() { stop(); cancelWork() }
}
