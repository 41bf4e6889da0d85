package servers

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver
)

// PostgreSQL is a PostgreSQL cluster of its own (made with initdb, in its
// own directory, listening on its own port) that a test may stop, crash and
// restart without touching the shared server other tests use.
type PostgreSQL struct {
	// URL is the cluster's database postgres as user postgres (trust
	// authentication, no password), the same across restarts.
	URL string

	t       testing.TB
	bin     string // directory holding initdb and pg_ctl
	as      osUser // runs PostgreSQL's programs
	dir     string
	data    string
	logFile string
	port    int
}

// PostgreSQLOptions configures a private cluster beyond the package's own
// settings (trust authentication, fsync off, max_connections 200).
type PostgreSQLOptions struct {
	// Conf is appended to postgresql.conf after the package's settings (the
	// last setting of a name wins), e.g. "wal_level = logical\n".
	Conf string
	// CertFile and KeyFile, when set, turn TLS on (ssl = on): the server
	// presents this certificate and key. Clients may still connect
	// without TLS.
	CertFile, KeyFile string
}

// postgresBinDir finds initdb (on PATH, else the newest
// /usr/lib/postgresql/*/bin) and returns the directory it and pg_ctl are in.
func postgresBinDir() (string, bool) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		return filepath.Dir(p), true
	}
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	sort.Slice(found, func(i, j int) bool { return majorVersion(found[i]) > majorVersion(found[j]) })
	if len(found) == 0 {
		return "", false
	}
	return filepath.Dir(found[0]), true
}

// majorVersion is the number in /usr/lib/postgresql/<number>/bin/initdb.
func majorVersion(initdb string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(initdb))))
	return v
}

// StartPostgreSQL makes a private cluster with initdb in a fresh temporary
// directory and starts it on a free port of 127.0.0.1 (trust
// authentication, fsync off, max_connections 200), returning once a
// connection works. PostgreSQL refuses to run as root: a test running as
// root runs it as the postgres OS user. The cluster is stopped when t ends
// and its directory removed unless t failed. The test fails when PostgreSQL
// is not installed.
func StartPostgreSQL(t testing.TB) *PostgreSQL {
	t.Helper()
	return StartPostgreSQLWith(t, PostgreSQLOptions{})
}

// StartPostgreSQLWithTLS is StartPostgreSQL with TLS on (ssl = on), the
// server presenting the certificate and key in certFile and keyFile.
// Clients may still connect without TLS.
func StartPostgreSQLWithTLS(t testing.TB, certFile, keyFile string) *PostgreSQL {
	t.Helper()
	return StartPostgreSQLWith(t, PostgreSQLOptions{CertFile: certFile, KeyFile: keyFile})
}

// StartPostgreSQLWith is StartPostgreSQL configured by opts.
func StartPostgreSQLWith(t testing.TB, opts PostgreSQLOptions) *PostgreSQL {
	t.Helper()
	return initPostgreSQL(t, opts, "")
}

// LogicalConf is the PostgreSQLOptions.Conf of a cluster the WAL relay can
// read: wal_level = logical (the shared server stays at replica) and room
// for the slots and senders of tests running in parallel.
const LogicalConf = "wal_level = logical\nmax_replication_slots = 20\nmax_wal_senders = 20\n"

// StartLogicalPostgreSQL is StartPostgreSQL with LogicalConf.
func StartLogicalPostgreSQL(t testing.TB) *PostgreSQL {
	t.Helper()
	return initPostgreSQL(t, PostgreSQLOptions{Conf: LogicalConf}, "")
}

// initPostgreSQL makes a cluster with initdb, configures it (see
// configure) and starts it. initdb's pg_hba.conf trusts every user of
// 127.0.0.1, for replication too.
func initPostgreSQL(t testing.TB, opts PostgreSQLOptions, more string) *PostgreSQL {
	t.Helper()
	p := newPostgreSQL(t)
	began := time.Now()
	p.run("initdb", "-D", p.data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-locale", "--no-sync")
	p.configure(opts, more)
	t.Logf("private PostgreSQL cluster on port %d made by initdb in %s", p.port, time.Since(began).Round(time.Millisecond))
	p.Start()
	return p
}

// newPostgreSQL prepares a private cluster (port, directory, the user to
// run it as, cleanup) whose data directory is still to be made.
func newPostgreSQL(t testing.TB) *PostgreSQL {
	t.Helper()
	bin, ok := postgresBinDir()
	if !ok {
		t.Fatalf("PostgreSQL's initdb is neither on PATH nor in /usr/lib/postgresql/*/bin: install PostgreSQL (`make up` does)")
	}
	p := &PostgreSQL{t: t, bin: bin, port: FreePort(t)}
	// The directory goes to the temporary directory: the Unix socket's
	// path in it must stay short.
	dir, err := os.MkdirTemp("", "millrace-pg-")
	if err != nil {
		t.Fatalf("create the private PostgreSQL cluster's directory: %v", err)
	}
	p.dir, p.data, p.logFile = dir, filepath.Join(dir, "data"), filepath.Join(dir, "postgres.log")
	p.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.port)
	if p.as, err = serverUser(dir); err != nil {
		_ = os.RemoveAll(dir)
		t.Fatalf("PostgreSQL does not run as root, and running it as the OS user postgres is not possible: %v", err)
	}
	watch(t, "private PostgreSQL cluster", dir,
		p.shellCommand("pg_ctl", "-D", p.data, "stop", "-m", "immediate", "-w")+" >/dev/null 2>&1", p.Stop)
	return p
}

// configure appends the cluster's own settings, then more, then opts.Conf
// to postgresql.conf, and copies in opts' TLS files.
func (p *PostgreSQL) configure(opts PostgreSQLOptions, more string) {
	p.t.Helper()
	conf := fmt.Sprintf(`
listen_addresses = '127.0.0.1'
port = %d
unix_socket_directories = '%s'
fsync = off
max_connections = 200
`, p.port, p.data) + more
	if opts.CertFile != "" {
		// server.crt and server.key in the data directory are PostgreSQL's
		// defaults; the key must belong to the server's user, mode 0600.
		for dst, src := range map[string]string{"server.crt": opts.CertFile, "server.key": opts.KeyFile} {
			if err := p.copyIn(src, dst); err != nil {
				p.t.Fatalf("give the private PostgreSQL cluster its TLS files: %v", err)
			}
		}
		conf += "ssl = on\n"
	}
	conf += opts.Conf + "\n"
	f, err := os.OpenFile(filepath.Join(p.data, "postgresql.conf"), os.O_WRONLY|os.O_APPEND, 0)
	if err == nil {
		_, err = f.WriteString(conf)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		p.t.Fatalf("configure the private PostgreSQL cluster: %v", err)
	}
}

// copyIn copies the file src into the data directory as name, readable
// only by the server's user.
func (p *PostgreSQL) copyIn(src, name string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	dst := filepath.Join(p.data, name)
	if err := os.WriteFile(dst, data, 0o600); err != nil {
		return err
	}
	return p.as.chown(dst)
}

// command returns the command that runs PostgreSQL's program name with args
// as the cluster's user.
func (p *PostgreSQL) command(name string, args ...string) *exec.Cmd {
	return p.as.command(filepath.Join(p.bin, name), args...)
}

// shellCommand is command as a /bin/sh command line.
func (p *PostgreSQL) shellCommand(name string, args ...string) string {
	cmd := p.command(name, args...)
	words := make([]string, len(cmd.Args))
	words[0] = shellQuote(cmd.Path)
	for i, a := range cmd.Args[1:] {
		words[i+1] = shellQuote(a)
	}
	return strings.Join(words, " ")
}

// run runs PostgreSQL's program name with args and fails the test, showing
// its output and the end of the server log, if it fails.
func (p *PostgreSQL) run(name string, args ...string) {
	p.t.Helper()
	out, err := p.command(name, args...).CombinedOutput()
	if err != nil {
		p.t.Fatalf("%s %s: %v\n%s\nserver log:\n%s", name, strings.Join(args, " "), err, out, p.logTail())
	}
}

// Start starts the cluster (pg_ctl start) and returns once a connection
// works. After Crash the server recovers from its write-ahead log first.
func (p *PostgreSQL) Start() {
	p.t.Helper()
	began := time.Now()
	p.run("pg_ctl", "-D", p.data, "-l", p.logFile, "-w", "-t", "120", "start")
	db, err := sql.Open("pgx", p.URL)
	if err != nil {
		p.t.Fatalf("open %s: %v", p.URL, err)
	}
	defer db.Close()
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := db.PingContext(ctx)
		cancel()
		if err == nil {
			p.t.Logf("private PostgreSQL cluster on port %d up after %s", p.port, time.Since(began).Round(time.Millisecond))
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("private PostgreSQL cluster on port %d does not answer: %v\n%s", p.port, err, p.logTail())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Stop stops the cluster cleanly (pg_ctl stop -m fast: sessions are
// disconnected, then a shutdown checkpoint). It does nothing when the
// cluster is not running.
func (p *PostgreSQL) Stop() {
	p.t.Helper()
	p.stop("fast", "stopped")
}

// Crash stops the cluster the way a crash would (pg_ctl stop -m immediate:
// no shutdown checkpoint), so the next Start runs crash recovery. It does
// nothing when the cluster is not running.
func (p *PostgreSQL) Crash() {
	p.t.Helper()
	p.stop("immediate", "crashed (immediate stop)")
}

// Restart crashes the cluster and starts it again: a crash restart, with
// crash recovery, on the same port and data directory.
func (p *PostgreSQL) Restart() {
	p.t.Helper()
	restart(p.t, fmt.Sprintf("private PostgreSQL cluster on port %d", p.port), "crash-restarted", p.Crash, p.Start)
}

// restart runs stop, then start, and logs "<what> <done> in <duration>".
func restart(t testing.TB, what, done string, stop, start func()) {
	t.Helper()
	began := time.Now()
	stop()
	start()
	t.Logf("%s %s in %s", what, done, time.Since(began).Round(time.Millisecond))
}

// Promote makes a standby a primary (pg_ctl promote) and returns once it
// accepts writes.
func (p *PostgreSQL) Promote() {
	p.t.Helper()
	began := time.Now()
	p.run("pg_ctl", "-D", p.data, "promote", "-w", "-t", "120")
	p.t.Logf("private PostgreSQL cluster on port %d promoted in %s", p.port, time.Since(began).Round(time.Millisecond))
}

// WALPosition returns how far the cluster's write-ahead log goes, as
// PostgreSQL prints a log sequence number (0/3000148): on a primary, as
// far as it has written (pg_current_wal_lsn); on a standby, as far as it
// has replayed (pg_last_wal_replay_lsn).
func (p *PostgreSQL) WALPosition(ctx context.Context) (string, error) {
	var lsn string
	err := p.queryRow(ctx, `SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
		ELSE pg_current_wal_lsn() END::text`, nil, &lsn)
	return lsn, err
}

// PID returns the process id of the cluster's postmaster, the first line
// of postmaster.pid in its data directory; the cluster must be running.
func (p *PostgreSQL) PID() (int, error) {
	data, err := os.ReadFile(filepath.Join(p.data, "postmaster.pid"))
	if err != nil {
		return 0, fmt.Errorf("the private PostgreSQL cluster on port %d: %w", p.port, err)
	}
	first, _, _ := strings.Cut(string(data), "\n")
	return strconv.Atoi(strings.TrimSpace(first))
}

// queryRow runs query with args on the cluster, on a connection of its
// own, and scans its one row into dest.
func (p *PostgreSQL) queryRow(ctx context.Context, query string, args []any, dest ...any) error {
	db, err := sql.Open("pgx", p.URL)
	if err != nil {
		return err
	}
	defer db.Close()
	return db.QueryRowContext(ctx, query, args...).Scan(dest...)
}

// stop runs pg_ctl stop in mode, if the cluster runs (has a postmaster.pid).
func (p *PostgreSQL) stop(mode, what string) {
	p.t.Helper()
	if _, err := os.Stat(filepath.Join(p.data, "postmaster.pid")); err != nil {
		return
	}
	began := time.Now()
	p.run("pg_ctl", "-D", p.data, "stop", "-m", mode, "-w", "-t", "120")
	p.t.Logf("private PostgreSQL cluster on port %d %s after %s", p.port, what, time.Since(began).Round(time.Millisecond))
}

// logTail returns the end of the server's log.
func (p *PostgreSQL) logTail() string {
	logs, _ := os.ReadFile(p.logFile)
	return tail(string(logs), 3000)
}
