package relaybench_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/procfs"

	"github.com/millrace-io/millrace/forwarder/wal"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// clockTicks is how many clock ticks /proc/<pid>/stat counts a CPU second
// as: sysconf(_SC_CLK_TCK), which is 100 on Linux (procfs assumes the same).
const clockTicks = 100

// pgMark is where the bench's PostgreSQL stood when a measurement window
// opened: the CPU time its processes had used and its WAL position.
type pgMark struct {
	cpu float64 // seconds
	lsn string  // pg_current_wal_lsn()
}

// markPG checkpoints the server, so that every relay's window starts
// right after a checkpoint (alike in full-page writes) and no timed
// checkpoint falls in it, and returns where its CPU time and WAL stand.
func markPG(b *testing.B, ctx context.Context, pg *servers.PostgreSQL, db *sql.DB) pgMark {
	if _, err := db.ExecContext(ctx, `CHECKPOINT`); err != nil {
		b.Fatal(err)
	}
	m := pgMark{cpu: pgCPU(b, pg)}
	if err := db.QueryRowContext(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&m.lsn); err != nil {
		b.Fatal(err)
	}
	return m
}

// per10k returns the CPU seconds and the WAL, in MB of 2^20 bytes like peak
// RSS, that the server spent since m, per 10,000 of the window's events.
func (m pgMark) per10k(b *testing.B, ctx context.Context, pg *servers.PostgreSQL, db *sql.DB, events int) (cpuS, walMB float64) {
	cpuS = pgCPU(b, pg) - m.cpu
	var walBytes float64
	if err := db.QueryRowContext(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8`, m.lsn).Scan(&walBytes); err != nil {
		b.Fatal(err)
	}
	scale := 10_000 / float64(events)
	return cpuS * scale, walBytes / (1 << 20) * scale
}

// pgCPU is the CPU time, in seconds, the server's processes have used:
// user plus system time (utime, stime) of the postmaster and of each of
// its live children, plus the postmaster's cutime and cstime, the time of
// its children that have exited.
func pgCPU(b *testing.B, pg *servers.PostgreSQL) float64 {
	pid, err := pg.PID()
	if err != nil {
		b.Fatal(err)
	}
	procs, err := procfs.AllProcs()
	if err != nil {
		b.Fatal(err)
	}
	ticks, found := 0, false
	for _, p := range procs {
		st, err := p.Stat()
		if err != nil {
			continue // exited since it was listed: its time is in the postmaster's cutime
		}
		switch {
		case st.PID == pid:
			ticks += int(st.UTime+st.STime) + st.CUTime + st.CSTime
			found = true
		case st.PPID == pid:
			ticks += int(st.UTime + st.STime)
		}
	}
	if !found {
		b.Fatalf("no process %d, the bench's PostgreSQL postmaster", pid)
	}
	return float64(ticks) / clockTicks
}

// dropSlot drops a WAL relay's slot after its relay has stopped, so that
// the WAL it retains does not pile up under the relays measured after it;
// the slot stays in use for a moment after the relay exits, until its
// walsender has ended.
func dropSlot(b *testing.B, slot wal.Config) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	testkit.Eventually(b, 30*time.Second, "the slot "+slot.Slot+" is dropped", func() bool {
		err := wal.DropSlot(ctx, slot.URL, slot.Slot)
		return err == nil || errors.Is(err, wal.ErrNoSlot)
	})
}
