package wal_test

import (
	"context"
	"errors"
	"testing"

	"github.com/millrace-io/millrace/forwarder/wal"
)

// A Reader stopped with batches handed out but not acknowledged confirmed
// nothing past them: the next Reader gets them again, and not what was
// acknowledged before. DropSlot then removes the slot.
func testRestartRedelivers(t *testing.T, s *logicalServer) {
	cfg := s.outbox(t)
	r := newReader(t, cfg)
	acked, held := make(chan wal.Batch, 1), make(chan wal.Batch, 1)
	first := true
	insert(t, s.db, cfg, "u1")
	rn := run(t, r, func(ctx context.Context, b wal.Batch) error {
		if first { // the broker confirms u1's batch
			first = false
			acked <- b
			return nil
		}
		held <- b // the broker never confirms
		<-ctx.Done()
		return ctx.Err()
	})
	b1 := receive(t, acked, "batch")
	if got := uuids(b1.Transactions[0]); got != "u1" {
		t.Fatalf("first batch %q, want u1", got)
	}
	slotStatus(t, cfg, r.Slot(), "u1 is confirmed", func(st wal.SlotStatus) bool { return st.ConfirmedFlushLSN >= b1.LSN() })
	insert(t, s.db, cfg, "u2")
	insert(t, s.db, cfg, "u3")
	b2 := receive(t, held, "batch")
	rn.stop(t) // mid-stream, u2's batch unconfirmed
	st := slotStatus(t, cfg, r.Slot(), "the slot is released", func(st wal.SlotStatus) bool { return !st.Active })
	if st.ConfirmedFlushLSN > b2.Transactions[0].CommitLSN {
		t.Fatalf("confirmed %s, past unacknowledged u2 committed at %s", st.ConfirmedFlushLSN, b2.Transactions[0].CommitLSN)
	}

	got := newCollector()
	rn2 := run(t, newReader(t, cfg), got.handle)
	if a, b := uuids(got.next(t)), uuids(got.next(t)); a != "u2" || b != "u3" {
		t.Fatalf("after the restart got %q, %q; want u2, u3", a, b)
	}
	rn2.stop(t)
	slotStatus(t, cfg, r.Slot(), "the slot is released", func(st wal.SlotStatus) bool { return !st.Active })
	if err := wal.DropSlot(context.Background(), cfg.URL, r.Slot()); err != nil {
		t.Fatal(err)
	}
	if _, err := wal.Status(context.Background(), cfg.URL, r.Slot()); !errors.Is(err, wal.ErrNoSlot) {
		t.Errorf("Status after DropSlot: %v, want ErrNoSlot", err)
	}
}

// An idle outbox's slot keeps advancing with the server's WAL, so that it
// retains none: other tables' writes are confirmed through keepalives. A
// second reader of the slot gets ErrSlotActive.
func testHeartbeatAdvances(t *testing.T, s *logicalServer) {
	cfg := s.outbox(t)
	r := newReader(t, cfg)
	run(t, r, newCollector().handle)
	if _, err := s.db.Exec(`CREATE TABLE "` + cfg.Schema + `".other (n int); INSERT INTO "` + cfg.Schema + `".other VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	var target wal.LSN
	if err := s.db.QueryRow(`SELECT pg_current_wal_lsn()::text`).Scan(&target); err != nil {
		t.Fatal(err)
	}
	st := slotStatus(t, cfg, r.Slot(), "the idle slot confirms "+target.String(),
		func(st wal.SlotStatus) bool { return st.ConfirmedFlushLSN >= target })
	if !st.Active || st.WALStatus == "lost" || st.RetainedBytes < 0 {
		t.Errorf("slot status %+v", st)
	}
	// Only one reader at a time: another is told the slot is read.
	if err := newReader(t, cfg).Run(context.Background(), newCollector().handle); !errors.Is(err, wal.ErrSlotActive) {
		t.Errorf("a second Run: %v, want ErrSlotActive", err)
	}
}

// A Handler's error stops Run with that error, and the batch comes again
// on the next Run of the same Reader.
func testHandlerErrorStopsRun(t *testing.T, s *logicalServer) {
	cfg := s.outbox(t)
	r := newReader(t, cfg)
	insert(t, s.db, cfg, "e1")
	down := errors.New("broker down")
	err := r.Run(context.Background(), func(context.Context, wal.Batch) error { return down })
	if !errors.Is(err, down) {
		t.Fatalf("Run returned %v, want the Handler's error", err)
	}
	slotStatus(t, cfg, r.Slot(), "the slot is released", func(st wal.SlotStatus) bool { return !st.Active })
	got := newCollector()
	run(t, r, got.handle)
	if id := uuids(got.next(t)); id != "e1" {
		t.Fatalf("after the error got %q, want e1 again", id)
	}
}
