package servers

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// Replication is how a primary's commits wait for its standby.
type Replication int

const (
	// Asynchronous: a commit returns once the primary has it; the standby
	// follows as fast as it can (PostgreSQL's default).
	Asynchronous Replication = iota
	// Synchronous: a commit returns once the standby has flushed it too
	// (the primary's synchronous_standby_names names the standby;
	// synchronous_commit is on).
	Synchronous
)

// standbyName is the standby's application_name, which the primary's
// synchronous_standby_names names, and its replication slot's name.
const standbyName = "standby"

// PrimaryStandby is a private primary with one streaming standby, made
// from it with pg_basebackup, for failover tests: crash the primary
// (Primary.Crash), promote the standby (Standby.Promote), and connect
// through URL to whichever accepts writes. Nothing rewinds the old
// primary: started again after a failover, it is a second primary.
type PrimaryStandby struct {
	Primary, Standby *PostgreSQL
	// URL names both clusters, the primary first, with
	// target_session_attrs=read-write: a connection goes to the first that
	// answers and accepts writes, the standby once it is promoted.
	URL string

	t testing.TB
}

// StartPrimaryStandby starts a private primary (StartPostgreSQLWith opts)
// and a standby that streams from it through a replication slot, hot (it
// answers queries) and configured by opts too, and returns once the
// standby streams. The standby waits for no standby of its own once
// promoted.
func StartPrimaryStandby(t testing.TB, mode Replication, opts PostgreSQLOptions) *PrimaryStandby {
	t.Helper()
	var sync string
	if mode == Synchronous {
		sync = fmt.Sprintf("synchronous_standby_names = '%s'\nsynchronous_commit = on\n", standbyName)
	}
	primary := initPostgreSQL(t, opts, sync)
	standby := newPostgreSQL(t)
	began := time.Now()
	// -R writes standby.signal and primary_conninfo (with the
	// application_name given here); -C -S a slot keeps on the primary
	// whatever WAL the standby has not received, also while it is
	// stopped.
	standby.run("pg_basebackup", "-D", standby.data, "-R", "-X", "stream", "-c", "fast", "--no-sync",
		"-C", "-S", standbyName,
		"-d", fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", primary.port, standbyName))
	// The base backup copied the primary's synchronous_standby_names:
	// promoted, the standby would wait for a standby of its own forever.
	standby.configure(opts, "synchronous_standby_names = ''\n")
	t.Logf("private PostgreSQL standby on port %d made by pg_basebackup in %s", standby.port, time.Since(began).Round(time.Millisecond))
	standby.Start()
	s := &PrimaryStandby{
		Primary: primary,
		Standby: standby,
		URL: fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?target_session_attrs=read-write&sslmode=disable",
			primary.port, standby.port),
		t: t,
	}
	s.waitStreaming(mode)
	return s
}

// waitStreaming waits until the primary lists the standby as streaming,
// and as synchronous if mode says so: a standby is listed as asynchronous
// until it has reported how far it has flushed, and until then commits do
// not wait for it.
func (s *PrimaryStandby) waitStreaming(mode Replication) {
	s.t.Helper()
	want := map[Replication]string{Asynchronous: "async", Synchronous: "sync"}[mode]
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var state, syncState string
		err := s.Primary.queryRow(ctx, `SELECT state, sync_state FROM pg_stat_replication
			WHERE application_name = $1 ORDER BY backend_start DESC LIMIT 1`, []any{standbyName}, &state, &syncState)
		cancel()
		if err == nil && state == "streaming" && syncState == want {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("the private standby on port %d does not stream from the primary on port %d as %s standby (%q, %q, %v)\nprimary log:\n%s\nstandby log:\n%s",
				s.Standby.port, s.Primary.port, want, state, syncState, err, s.Primary.logTail(), s.Standby.logTail())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Behind returns how many bytes of write-ahead log up to lsn (a
// WALPosition of the primary) the standby has not replayed: 0 once it has
// everything the primary had written at lsn. After a failover it is what
// the promoted standby never got.
func (s *PrimaryStandby) Behind(ctx context.Context, lsn string) (int64, error) {
	var behind int64
	err := s.Standby.queryRow(ctx, `SELECT greatest(pg_wal_lsn_diff($1::pg_lsn, pg_last_wal_replay_lsn()), 0)::bigint`,
		[]any{lsn}, &behind)
	return behind, err
}
