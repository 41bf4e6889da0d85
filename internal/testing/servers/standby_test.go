package servers

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// open returns a pool on url, closed when the test ends.
func open(t *testing.T, url string) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", url)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	return db
}

// ids returns the ids in table kept, in order, or the query's error (when
// there is no such table yet, say).
func ids(t *testing.T, ctx context.Context, db *sql.DB) ([]int, error) {
	t.Helper()
	rows, err := db.QueryContext(ctx, `SELECT id FROM kept ORDER BY id`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var got []int
	for rows.Next() {
		var id int
		require.NoError(t, rows.Scan(&id))
		got = append(got, id)
	}
	return got, rows.Err()
}

// serverPort is the port of the server db's next connection reaches.
func serverPort(t *testing.T, ctx context.Context, db *sql.DB) int {
	t.Helper()
	var port int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT inet_server_port()`).Scan(&port))
	return port
}

// Settings in PostgreSQLOptions.Conf win over the package's; the others
// stay.
func TestPostgreSQLWithConf(t *testing.T) {
	t.Parallel()
	pg := StartPostgreSQLWith(t, PostgreSQLOptions{Conf: "wal_level = logical\nmax_connections = 50"})
	db := open(t, pg.URL)
	var walLevel, maxConns, fsync string
	require.NoError(t, db.QueryRow(`SELECT current_setting('wal_level'), current_setting('max_connections'), current_setting('fsync')`).
		Scan(&walLevel, &maxConns, &fsync))
	require.Equal(t, []string{"logical", "50", "off"}, []string{walLevel, maxConns, fsync})
}

// An asynchronous standby replays what the primary commits and refuses
// writes. Stopped, it misses what the primary commits meanwhile: promoted
// after the primary's crash it lacks that commit, and Behind says how much
// write-ahead log it missed.
func TestPrimaryStandbyAsynchronous(t *testing.T) {
	t.Parallel()
	s := StartPrimaryStandby(t, Asynchronous, PostgreSQLOptions{})
	ctx := testContext(t)
	primary, standby := open(t, s.Primary.URL), open(t, s.Standby.URL)
	_, err := primary.ExecContext(ctx, `CREATE TABLE kept (id int PRIMARY KEY); INSERT INTO kept VALUES (1)`)
	require.NoError(t, err)
	testkit.Eventually(t, time.Minute, "the standby has the committed row", func() bool {
		got, err := ids(t, ctx, standby)
		return err == nil && len(got) == 1
	})
	_, err = standby.ExecContext(ctx, `INSERT INTO kept VALUES (2)`)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr) && pgErr.Code == "25006", "a write on the standby: %v", err)
	lsn, err := s.Primary.WALPosition(ctx)
	require.NoError(t, err)
	testkit.Eventually(t, time.Minute, "the standby has replayed the primary's WAL", func() bool {
		behind, err := s.Behind(ctx, lsn)
		return err == nil && behind == 0
	})

	s.Standby.Stop()
	_, err = primary.ExecContext(ctx, `INSERT INTO kept VALUES (2)`)
	require.NoError(t, err, "an asynchronous primary commits without its standby")
	lsn, err = s.Primary.WALPosition(ctx)
	require.NoError(t, err)
	s.Primary.Crash()
	s.Standby.Start()
	s.Standby.Promote()
	behind, err := s.Behind(ctx, lsn)
	require.NoError(t, err)
	require.Positive(t, behind, "the promoted standby replayed the primary's WAL up to %s", lsn)
	t.Logf("the promoted standby missed %d bytes of WAL, up to %s", behind, lsn)
	promoted := open(t, s.Standby.URL) // the other pool's connections ended with the standby's stop
	got, err := ids(t, ctx, promoted)
	require.NoError(t, err)
	require.Equal(t, []int{1}, got, "the promoted standby has the commit made while it was down")
	_, err = promoted.ExecContext(ctx, `INSERT INTO kept VALUES (2)`)
	require.NoError(t, err, "the promoted standby takes writes")
}

// A synchronous primary's commit waits, while the standby is down, until
// the standby is back.
func TestPrimaryStandbySynchronous(t *testing.T) {
	t.Parallel()
	s := StartPrimaryStandby(t, Synchronous, PostgreSQLOptions{})
	ctx := testContext(t)
	primary := open(t, s.Primary.URL)
	var syncState string
	require.NoError(t, primary.QueryRowContext(ctx, `SELECT sync_state FROM pg_stat_replication WHERE application_name = $1`,
		standbyName).Scan(&syncState))
	require.Equal(t, "sync", syncState)
	_, err := primary.ExecContext(ctx, `CREATE TABLE kept (id int PRIMARY KEY); INSERT INTO kept VALUES (1)`)
	require.NoError(t, err)

	s.Standby.Stop()
	committed := make(chan error, 1)
	go func() {
		_, err := primary.ExecContext(ctx, `INSERT INTO kept VALUES (2)`)
		committed <- err
	}()
	testkit.Eventually(t, time.Minute, "the commit waits for the synchronous standby", func() bool {
		var waiting int
		err := primary.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`).Scan(&waiting)
		return err == nil && waiting == 1
	})
	select {
	case err := <-committed:
		t.Fatalf("the commit returned while the synchronous standby was down: %v", err)
	default:
	}
	s.Standby.Start()
	require.NoError(t, <-committed, "the commit once the standby is back")
	got, err := ids(t, ctx, open(t, s.Standby.URL))
	require.NoError(t, err)
	require.Contains(t, got, 2)
}

// A pool on the multi-host URL writes to the primary (also when the URL
// names the standby first), and after the primary's crash and the
// standby's promotion it writes to the promoted standby, which has every
// row the synchronous primary committed and waits for no standby itself.
func TestPrimaryStandbyFailover(t *testing.T) {
	t.Parallel()
	s := StartPrimaryStandby(t, Synchronous, PostgreSQLOptions{})
	ctx := testContext(t)
	cfg, err := pgx.ParseConfig(s.URL)
	require.NoError(t, err)
	require.Len(t, cfg.Fallbacks, 1, "pgx reads two hosts from %s", s.URL)
	require.EqualValues(t, s.Standby.port, cfg.Fallbacks[0].Port)
	standbyFirst := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?target_session_attrs=read-write&sslmode=disable",
		s.Standby.port, s.Primary.port)
	require.Equal(t, s.Primary.port, serverPort(t, ctx, open(t, standbyFirst)), "target_session_attrs=read-write skips the standby")

	db := open(t, s.URL)
	_, err = db.ExecContext(ctx, `CREATE TABLE kept (id int PRIMARY KEY)`)
	require.NoError(t, err)
	for id := 1; id <= 10; id++ {
		_, err := db.ExecContext(ctx, `INSERT INTO kept VALUES ($1)`, id)
		require.NoError(t, err)
	}
	require.Equal(t, s.Primary.port, serverPort(t, ctx, db))
	lsn, err := s.Primary.WALPosition(ctx)
	require.NoError(t, err)

	s.Primary.Crash()
	s.Standby.Promote()
	behind, err := s.Behind(ctx, lsn)
	require.NoError(t, err)
	t.Logf("the promoted synchronous standby is %d bytes of WAL short of the primary's last position %s", behind, lsn)
	testkit.Eventually(t, time.Minute, "the pool writes to the promoted standby", func() bool {
		_, err := db.ExecContext(ctx, `INSERT INTO kept VALUES (11) ON CONFLICT DO NOTHING`)
		return err == nil
	})
	require.Equal(t, s.Standby.port, serverPort(t, ctx, db))
	got, err := ids(t, ctx, db)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, got)
}
