package forwarder

import (
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

// forwardBatch reads one batch in a transaction that locks the relay's
// offsets row, publishes it, and acks the longest prefix of rows the broker
// confirmed (or that were quarantined). It returns how many rows it acked,
// whether rows past them are hidden for now by an older open transaction,
// and an error when it stopped at a retryable failure.
func (f *Forwarder) forwardBatch(ctx context.Context) (handled int, hidden bool, err error) {
	// The batch may outlive ctx by shutdown_timeout so that a stopping relay
	// acks what the broker already confirmed.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	stop := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(f.cfg.ShutdownTimeout, cancelWork)
		context.AfterFunc(work, func() { t.Stop() })
	})
	defer stop()

	began := time.Now()
	tx, err := f.db.BeginTx(work, &sql.TxOptions{Isolation: f.tables.RelayIsolation()})
	if err != nil {
		f.recordRead(began, 0, false, err)
		return 0, false, fmt.Errorf("begin batch: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit

	rows, hidden, ok, err := f.takeAhead(work, tx)
	if err == nil && !ok {
		rows, hidden, err = f.readBatch(work, tx)
	}
	f.recordRead(began, len(rows), hidden, err)
	if err != nil || len(rows) == 0 {
		if err == nil {
			err = tx.Commit()
		}
		return 0, hidden, err
	}
	if len(rows) == f.cfg.BatchSize {
		// A full batch: more is likely pending, so read it while this one
		// is published and acked.
		f.readAhead(ctx, store.PositionOf(rows[len(rows)-1].row))
	}

	confirmed, publishErr := f.publish(work, rows)
	if confirmed == 0 {
		return 0, hidden, publishErr
	}
	if err := f.ack(work, tx, rows[:confirmed]); err != nil {
		return 0, hidden, err
	}
	if err := tx.Commit(); err != nil {
		return 0, hidden, fmt.Errorf("commit batch: %w", err)
	}
	f.recordBatch(rows[:confirmed])
	return confirmed, hidden, publishErr
}

// readBatch reads the next batch (store.ReadBatch: the FOR UPDATE lock on
// the offsets row and the xid8 visibility rule) and unwraps it.
func (f *Forwarder) readBatch(ctx context.Context, tx *sql.Tx) (rows []outboxRow, hidden bool, err error) {
	read, hidden, err := f.tables.ReadBatch(ctx, tx, f.cursor, f.cfg.BatchSize)
	if err != nil {
		return nil, false, err
	}
	return f.unwrap(read), hidden, nil
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

// ahead is the next batch, read (store.ReadAfter) while the batch in flight
// is published, from the position that batch acks once all of it is handled.
type ahead struct {
	after  store.Position
	done   chan struct{} // closed once the rows, hidden and err are set
	rows   []outboxRow
	hidden bool
	err    error
}

// readAhead starts reading the batch after pos.
func (f *Forwarder) readAhead(ctx context.Context, after store.Position) {
	a := &ahead{after: after, done: make(chan struct{})}
	f.ahead = a
	go func() {
		defer close(a.done)
		read, hidden, err := f.tables.ReadAfter(ctx, f.db, f.cursor, after, f.cfg.BatchSize)
		if err == nil {
			a.rows, a.hidden = f.unwrap(read), hidden
		}
		a.err = err
	}()
}

// takeAhead locks the offsets row in tx and returns the batch read ahead if
// it was read after the position found there: only then is it the batch
// ReadBatch would read now (the rows before the xid8 horizon at its read are
// final, and the horizon never moves back). Otherwise (a partial or failed
// batch before it, a failed read, another relay's ack) ok is false and the
// caller reads under the lock it now holds.
func (f *Forwarder) takeAhead(ctx context.Context, tx *sql.Tx) (rows []outboxRow, hidden, ok bool, err error) {
	a := f.ahead
	if a == nil {
		return nil, false, false, nil
	}
	f.ahead = nil
	<-a.done
	if a.err != nil {
		return nil, false, false, nil
	}
	pos, err := f.tables.LockPosition(ctx, tx, f.cursor)
	if err != nil || pos != a.after {
		return nil, false, false, err
	}
	return a.rows, a.hidden, true, nil
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

// ack moves quarantined rows aside and records the last handled row as the
// relay's position, in the batch transaction.
func (f *Forwarder) ack(ctx context.Context, tx *sql.Tx, handled []outboxRow) error {
	for _, r := range handled {
		if r.quarantine == "" {
			continue
		}
		if err := f.quarantineRow(ctx, tx, r); err != nil {
			return err
		}
	}
	return f.tables.Ack(ctx, tx, f.cursor, handled[len(handled)-1].row)
}

func (f *Forwarder) quarantineRow(ctx context.Context, tx *sql.Tx, r outboxRow) error {
	var topic, eventID string
	if r.out.Msg != nil {
		topic, eventID = r.out.Topic, r.out.Msg.UUID
	} else {
		f.metrics.publishErrors.WithLabelValues(errorClassCorrupt).Inc()
	}
	if err := f.tables.Quarantine(ctx, tx, r.row, topic, eventID, r.quarantine); err != nil {
		return err
	}
	f.metrics.quarantined.Inc()
	f.logger.Error("Outbox row moved to the relay quarantine", errors.New(r.quarantine), watermill.LogFields{
		"outbox_offset": r.row.Offset, "event_id": eventID, "topic": topic,
	})
	return nil
}
