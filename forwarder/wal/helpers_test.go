package wal_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver

	"github.com/millrace-io/millrace/forwarder/wal"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// waitFor bounds every wait of these tests: it only catches a hang.
const waitFor = 20 * time.Second

// logicalServer is the package's private PostgreSQL with wal_level =
// logical, shared by the subtests of one test function.
type logicalServer struct {
	url string
	db  *sql.DB
}

// startLogicalServer starts the private cluster, stopped when t ends.
func startLogicalServer(t *testing.T) *logicalServer {
	t.Helper()
	pg := servers.StartPostgreSQLWith(t, servers.PostgreSQLOptions{
		Conf: "wal_level = logical\nmax_replication_slots = 10\nmax_wal_senders = 10"})
	db, err := sql.Open("pgx", pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return &logicalServer{url: pg.URL, db: db}
}

// outbox migrates an outbox of its own for t and returns a Config reading
// it through a slot and publication of its own.
func (s *logicalServer) outbox(t *testing.T) wal.Config {
	t.Helper()
	tables := store.Tables{Schema: testdb.UniqueName(t.Name()), OutboxTopic: "events"}
	if err := store.Migrate(context.Background(), s.db, tables); err != nil {
		t.Fatal(err)
	}
	return wal.Config{URL: s.url, Schema: tables.Schema, OutboxTopic: tables.OutboxTopic,
		StatusInterval: 50 * time.Millisecond}
}

// execer is a *sql.DB or a *sql.Tx.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// insert writes an outbox row with uuid id in tx, as watermill-sql does.
func insert(t *testing.T, tx execer, cfg wal.Config, id string) {
	t.Helper()
	_, err := tx.ExecContext(context.Background(), `INSERT INTO "`+cfg.Schema+`"."watermill_`+cfg.OutboxTopic+
		`" (uuid, payload, metadata, transaction_id) VALUES ($1, $2, '{"k": "v"}', pg_current_xact_id())`,
		id, `{"id": "`+id+`"}`)
	if err != nil {
		t.Fatal(err)
	}
}

// running is a Reader's Run on a goroutine of its own.
type running struct {
	cancel context.CancelFunc
	done   chan error
}

// run starts r.Run with handle; stop ends it (also when t ends).
func run(t *testing.T, r *wal.Reader, handle wal.Handler) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	rn := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { rn.done <- r.Run(ctx, handle) }()
	t.Cleanup(func() { rn.stop(t) })
	return rn
}

// stop cancels Run and returns its error, which must be the cancellation.
func (rn *running) stop(t *testing.T) {
	t.Helper()
	rn.cancel()
	select {
	case err, ok := <-rn.done:
		if !ok {
			return // stopped already
		}
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Run returned %v, want context.Canceled", err)
		}
		close(rn.done)
	case <-time.After(waitFor):
		t.Fatalf("Run did not return within %s of its cancellation", waitFor)
	}
}

// collector is a Handler that acknowledges every batch and passes its
// transactions on.
type collector chan wal.Transaction

func newCollector() collector { return make(collector, 1000) }

func (c collector) handle(_ context.Context, b wal.Batch) error {
	for _, tx := range b.Transactions {
		c <- tx
	}
	return nil
}

// next returns the next transaction delivered.
func (c collector) next(t *testing.T) wal.Transaction {
	t.Helper()
	return receive(t, c, "transaction delivered")
}

// receive returns the next value of c, and fails t when none (what) comes
// within waitFor.
func receive[T any](t *testing.T, c <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(waitFor):
		t.Fatalf("no %s within %s", what, waitFor)
		var zero T
		return zero
	}
}

// uuids lists the outbox rows of tx by uuid.
func uuids(tx wal.Transaction) string {
	var ids []string
	for _, e := range tx.Events {
		if e.Row != nil {
			ids = append(ids, e.Row.UUID)
		}
	}
	return strings.Join(ids, ",")
}

// slotStatus polls the slot's status until cond holds.
func slotStatus(t *testing.T, cfg wal.Config, slot, what string, cond func(wal.SlotStatus) bool) wal.SlotStatus {
	t.Helper()
	var s wal.SlotStatus
	testkit.Eventually(t, waitFor, what, func() bool {
		var err error
		if s, err = wal.Status(context.Background(), cfg.URL, slot); err != nil {
			t.Fatal(err)
		}
		return cond(s)
	})
	return s
}
