package servers

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// connect opens a pgx connection on url, closed when the test ends.
func connect(t *testing.T, ctx context.Context, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// backendPID runs one transaction on conn and returns the server backend
// it ran on.
func backendPID(t *testing.T, ctx context.Context, conn *pgx.Conn) int {
	t.Helper()
	var pid int
	require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid)
	}))
	return pid
}

// pgx's default mode (cache_statement) prepares a named statement on
// whichever server connection the pooler lends: the next client with the
// same query, lent the same one, prepares it again and fails. Through the
// shared server and a private pooler in front of it.
func TestPgBouncerBreaksPreparedStatements(t *testing.T) {
	t.Parallel()
	b := StartPgBouncer(t, testdb.URL())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := b.URL("test")

	first, second := connect(t, ctx, url), connect(t, ctx, url)
	var n int
	require.NoError(t, first.QueryRow(ctx, `SELECT $1::int + 1`, 1).Scan(&n))
	require.Equal(t, 2, n)
	err := second.QueryRow(ctx, `SELECT $1::int + 1`, 1).Scan(&n)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "a second client's first use of the same statement: %v", err)
	require.Contains(t, []string{"42P05", "26000"}, pgErr.Code, "prepared statement already exists, or does not exist: %v", err)
	t.Logf("pgx cache_statement through PgBouncer: %v", err)
}

// pgx's modes that use no named prepared statement work through the
// pooler with many clients at once on few server connections: simple
// protocol, exec and cache_describe anywhere, describe_exec inside
// transactions only. (describe_exec describes, then binds and executes, on
// the unnamed statement in two round trips, between which the pooler may
// lend the server connection to another client: outside a transaction
// about half of its queries failed here, with "unnamed prepared statement
// does not exist" or with another client's statement bound to its
// arguments.)
func TestPgBouncerServesStatementlessModes(t *testing.T) {
	t.Parallel()
	pg := StartPostgreSQL(t)
	b := StartPgBouncer(t, pg.URL)
	for _, mode := range []string{"simple_protocol", "exec", "cache_describe", "describe_exec"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			db, err := sql.Open("pgx", b.URL("postgres")+"&default_query_exec_mode="+mode)
			require.NoError(t, err)
			defer db.Close()
			db.SetMaxOpenConns(8 * PgBouncerPoolSize)
			var wg sync.WaitGroup
			errs := make(chan error, 64*20)
			for c := range 64 {
				wg.Go(func() {
					for i := range 20 {
						errs <- queryPlusOne(ctx, db, mode == "describe_exec", c*100+i)
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
		})
	}
}

// queryPlusOne asks the server for n+1 (in a transaction if inTx) and
// checks the answer.
func queryPlusOne(ctx context.Context, db *sql.DB, inTx bool, n int) error {
	var got int
	if !inTx {
		if err := db.QueryRowContext(ctx, `SELECT $1::int + 1`, n).Scan(&got); err != nil {
			return err
		}
	} else {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		if err := tx.QueryRowContext(ctx, `SELECT $1::int + 1`, n).Scan(&got); err != nil {
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
	}
	if got != n+1 {
		return fmt.Errorf("%d + 1 = %d", n, got)
	}
	return nil
}

// Two transactions of one client run on different server backends when
// another client holds the first one's backend; under a crowd of clients
// the pooler opens no more than PgBouncerPoolSize backends, and its SHOW
// SERVERS lists the backends the clients saw.
func TestPgBouncerSharesServerBackends(t *testing.T) {
	t.Parallel()
	pg := StartPostgreSQL(t)
	b := StartPgBouncer(t, pg.URL)
	ctx := testContext(t)
	url := b.URL("postgres") + "&default_query_exec_mode=simple_protocol"

	client, other := connect(t, ctx, url), connect(t, ctx, url)
	firstPID := backendPID(t, ctx, client)
	held, err := other.Begin(ctx)
	require.NoError(t, err)
	var heldPID int
	require.NoError(t, held.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&heldPID))
	require.Equal(t, firstPID, heldPID, "the other client was lent the one idle backend")
	require.NotEqual(t, firstPID, backendPID(t, ctx, client), "the client's next transaction ran on the backend another client holds")
	require.NoError(t, held.Rollback(ctx))

	var mu sync.Mutex
	seen := map[int]bool{}
	var wg sync.WaitGroup
	for range 40 {
		conn := connect(t, ctx, url)
		wg.Go(func() {
			for range 10 {
				var pid int
				if err := conn.QueryRow(ctx, `SELECT pg_backend_pid() FROM pg_sleep(0.001)`).Scan(&pid); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				seen[pid] = true
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.LessOrEqual(t, len(seen), PgBouncerPoolSize, "backends used by 40 clients")
	servers, err := b.Show(ctx, "SERVERS")
	require.NoError(t, err)
	listed := map[int]bool{}
	for _, s := range servers {
		pid, err := strconv.Atoi(s["remote_pid"])
		require.NoError(t, err)
		listed[pid] = true
	}
	for pid := range seen {
		require.True(t, listed[pid], "backend %d is not in SHOW SERVERS %v", pid, servers)
	}
}

// The pooler comes back on the same URL after Kill and after Stop, and
// reaches its upstream again after the upstream's crash restart.
func TestPgBouncerRestart(t *testing.T) {
	t.Parallel()
	pg := StartPostgreSQL(t)
	b := StartPgBouncer(t, pg.URL)
	ctx := testContext(t)
	db, err := sql.Open("pgx", b.URL("postgres")+"&default_query_exec_mode=exec")
	require.NoError(t, err)
	defer db.Close()
	answers := func() bool {
		var one int
		return db.QueryRowContext(ctx, `SELECT 1`).Scan(&one) == nil && one == 1
	}
	require.True(t, answers())

	b.Kill()
	b.Kill() // killing a stopped pooler does nothing
	require.False(t, answers(), "the pooler still answers after Kill")
	b.Start()
	testkit.Eventually(t, 30*time.Second, "the restarted pooler answers", answers)

	b.Stop()
	require.False(t, answers(), "the pooler still answers after Stop")
	b.Start()
	testkit.Eventually(t, 30*time.Second, "the restarted pooler answers", answers)

	pg.Restart()
	testkit.Eventually(t, 30*time.Second, "the pooler answers through the restarted upstream", answers)
}
