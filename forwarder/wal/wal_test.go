package wal_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"strings"
	"testing"

	"github.com/millrace-io/millrace/forwarder/wal"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// TestWAL runs the tests that need wal_level = logical on one private
// cluster, each with an outbox, slot and publication of its own.
func TestWAL(t *testing.T) {
	s := startLogicalServer(t)
	tests := map[string]func(*testing.T, *logicalServer){
		"CommitOrder":            testCommitOrder,
		"LogicalMessages":        testLogicalMessages,
		"RestartRedelivers":      testRestartRedelivers,
		"HeartbeatAdvances":      testHeartbeatAdvances,
		"HandlerErrorStopsRun":   testHandlerErrorStopsRun,
		"NoReplicationPrivilege": testNoReplicationPrivilege,
		"NoPublicationPrivilege": testNoPublicationPrivilege,
	}
	for name, test := range tests {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t, s)
		})
	}
}

// newReader is wal.New that fails the test on error.
func newReader(t *testing.T, cfg wal.Config) *wal.Reader {
	t.Helper()
	r, err := wal.New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// Transactions come in commit order, whole: one that began first and
// committed last comes last, and while it is open it holds back nothing
// committed after it.
func testCommitOrder(t *testing.T, s *logicalServer) {
	cfg := s.outbox(t)
	got := newCollector()
	run(t, newReader(t, cfg), got.handle)
	ctx := context.Background()

	long, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Rollback() //nolint:errcheck // a no-op after Commit
	insert(t, long, cfg, "a1")
	insert(t, s.db, cfg, "b1")
	insert(t, s.db, cfg, "c1")
	b, c := got.next(t), got.next(t) // delivered while a1's transaction is open
	insert(t, long, cfg, "a2")
	if err := long.Commit(); err != nil {
		t.Fatal(err)
	}
	a := got.next(t)

	if uuids(b) != "b1" || uuids(c) != "c1" || uuids(a) != "a1,a2" {
		t.Fatalf("delivered %q, %q, %q; want b1, c1, a1,a2", uuids(b), uuids(c), uuids(a))
	}
	if !(b.EndLSN < c.CommitLSN && c.EndLSN < a.CommitLSN) {
		t.Errorf("commit LSNs out of order: %s-%s, %s-%s, %s-%s", b.CommitLSN, b.EndLSN, c.CommitLSN, c.EndLSN, a.CommitLSN, a.EndLSN)
	}
	a1, b1 := a.Events[0].Row, b.Events[0].Row
	if a1.Offset >= b1.Offset || a1.TransactionID >= b1.TransactionID {
		t.Errorf("a1 (offset %d, xid %d) was written before b1 (offset %d, xid %d)", a1.Offset, a1.TransactionID, b1.Offset, b1.TransactionID)
	}
	if string(a1.Payload) != `{"id": "a1"}` || string(a1.Metadata) != `{"k": "v"}` || a1.CreatedAt.IsZero() {
		t.Errorf("row a1 decoded as %+v", a1)
	}
}

// Logical messages under the configured prefix come byte for byte, in
// their transaction's order among its rows; other prefixes are skipped; a
// non-transactional one comes alone.
func testLogicalMessages(t *testing.T, s *logicalServer) {
	cfg := s.outbox(t)
	cfg.MessagePrefix = "millrace"
	got := newCollector()
	run(t, newReader(t, cfg), got.handle)
	ctx := context.Background()

	binary := []byte{0, 0xff, 0xfe, 'a', 0, 0x80, 0xc3, 0x28, 0}
	big := make([]byte, 64<<10)
	_, _ = rand.Read(big)
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	emit := func(ex execer, transactional bool, prefix string, content []byte) {
		t.Helper()
		if _, err := ex.ExecContext(ctx, `SELECT pg_logical_emit_message($1, $2, $3::bytea)`, transactional, prefix, content); err != nil {
			t.Fatal(err)
		}
	}
	emit(tx, true, "millrace", binary)
	insert(t, tx, cfg, "r1")
	emit(tx, true, "other", []byte("skipped"))
	emit(tx, true, "millrace", []byte{}) // empty, not NULL
	emit(tx, true, "millrace", big)
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	emit(s.db, false, "millrace", []byte("alone\x00"))

	first := got.next(t)
	want := [][]byte{binary, nil, nil, big} // nil at 1: the row
	if len(first.Events) != len(want) || uuids(first) != "r1" || first.Events[1].Row == nil {
		t.Fatalf("got %d events (rows %q), want 3 messages around row r1", len(first.Events), uuids(first))
	}
	for i, w := range want {
		if m := first.Events[i].Message; i != 1 && (m == nil || m.Prefix != "millrace" || !bytes.Equal(m.Content, w)) {
			t.Errorf("event %d: got %+v, want message of %d bytes", i, m, len(w))
		}
	}
	alone := got.next(t)
	if len(alone.Events) != 1 || alone.Xid != 0 || !bytes.Equal(alone.Events[0].Message.Content, []byte("alone\x00")) {
		t.Errorf("non-transactional message delivered as %+v", alone)
	}
}

// The requirement errors name the fix: on a server with wal_level =
// replica (a private one, so that the shared server's setting does not
// decide whether this runs) the setting and its restart.
func TestCheckNamesWALLevel(t *testing.T) {
	t.Parallel()
	pg := servers.StartPostgreSQLWith(t, servers.PostgreSQLOptions{Conf: "wal_level = replica"})
	err := wal.Check(context.Background(), pg.URL)
	if !errors.Is(err, wal.ErrWALLevel) {
		t.Fatalf("Check: %v, want ErrWALLevel", err)
	}
	for _, want := range []string{"wal_level = logical", "restart PostgreSQL"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Check's error %q does not say %q", err, want)
		}
	}
}

// A role without REPLICATION is told the ALTER ROLE that fixes it, by
// Check and by New.
func testNoReplicationPrivilege(t *testing.T, s *logicalServer) {
	role := testdb.UniqueName("norepl")
	if _, err := s.db.Exec(`CREATE ROLE "` + role + `" LOGIN`); err != nil {
		t.Fatal(err)
	}
	cfg := s.outbox(t)
	cfg.URL = strings.Replace(s.url, "postgres@", role+"@", 1)
	checkErr := wal.Check(context.Background(), cfg.URL)
	_, newErr := wal.New(context.Background(), cfg)
	for _, err := range []error{checkErr, newErr} {
		if !errors.Is(err, wal.ErrNoReplicationPrivilege) || !strings.Contains(err.Error(), `ALTER ROLE "`+role+`" REPLICATION`) {
			t.Errorf("got %v, want ErrNoReplicationPrivilege naming ALTER ROLE %q REPLICATION", err, role)
		}
	}
}

// A role with REPLICATION that may not create the publication is told
// the statement that creates it; once an operator ran it, New succeeds.
func testNoPublicationPrivilege(t *testing.T, s *logicalServer) {
	role := testdb.UniqueName("nopub")
	if _, err := s.db.Exec(`CREATE ROLE "` + role + `" LOGIN REPLICATION`); err != nil {
		t.Fatal(err)
	}
	cfg := s.outbox(t)
	if _, err := s.db.Exec(`GRANT USAGE ON SCHEMA "` + cfg.Schema + `" TO "` + role + `"`); err != nil {
		t.Fatal(err)
	}
	cfg.URL = strings.Replace(s.url, "postgres@", role+"@", 1)
	statement := wal.PublicationSQL(cfg.Schema, cfg.OutboxTopic)
	_, err := wal.New(context.Background(), cfg)
	_, sql, _ := strings.Cut(statement, "\n")
	if !errors.Is(err, wal.ErrPublication) || !strings.Contains(err.Error(), strings.TrimSpace(sql)) {
		t.Fatalf("New: %v, want ErrPublication naming %s", err, sql)
	}
	for range 2 { // and again: it skips an existing publication
		if _, err := s.db.Exec(statement); err != nil {
			t.Fatal(err)
		}
	}
	newReader(t, cfg)
}
