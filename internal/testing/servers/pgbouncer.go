package servers

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// PgBouncerPoolSize is how many server connections a private PgBouncer
// opens at most for one database and user (default_pool_size): few, so
// that clients really share them and session state leaks between clients.
const PgBouncerPoolSize = 4

// PgBouncer is a PgBouncer of its own, in transaction pooling mode in front
// of one PostgreSQL server, listening on its own port, that a test may
// stop, kill and restart.
type PgBouncer struct {
	t       testing.TB
	bin     string
	as      osUser // runs pgbouncer, which refuses to run as root
	dir     string
	conf    string
	pidFile string
	logFile string
	port    int
	user    string // the upstream URL's user

	mu     sync.Mutex
	cmd    *exec.Cmd     // the running pooler, nil when stopped
	done   chan struct{} // closed once cmd has exited
	output bytes.Buffer  // cmd's output, read once done is closed
}

// pgbouncerConf is a private PgBouncer's configuration. Any database name
// passes through to the same name upstream (the "*" entry). Clients are
// trusted, but a user must be in auth_file, which also holds the password
// for the upstream login (the upstream URL's, if any). pgx sends no startup
// parameter PgBouncer does not know; lib/pq sends extra_float_digits. Other
// runtime parameters in a client's URL (search_path, statement_timeout)
// are refused at login, not ignored: ignored, they would be silently lost.
// max_client_conn stays below the default limit of 1024 open files.
// server_login_retry is 1s, not 15s: a restarted upstream is used again at
// once.
const pgbouncerConf = `[databases]
* = host=%s port=%d

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
pidfile = %s
logfile = %s
auth_type = trust
auth_file = %s
admin_users = %s
pool_mode = transaction
default_pool_size = %d
max_client_conn = 1000
ignore_startup_parameters = extra_float_digits
server_login_retry = 1
`

// pgbouncerBin finds pgbouncer: on PATH, else where Debian's package puts
// it (/usr/sbin is not on a user's PATH there).
func pgbouncerBin() (string, bool) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, true
	}
	if _, err := os.Stat("/usr/sbin/pgbouncer"); err == nil {
		return "/usr/sbin/pgbouncer", true
	}
	return "", false
}

// StartPgBouncer starts a private PgBouncer on a free port of 127.0.0.1 in
// front of the PostgreSQL server upstreamURL names (one host: a private
// cluster's URL, or the shared server's), in transaction pooling mode with
// PgBouncerPoolSize server connections per database, and returns once it
// answers. Whatever its version, it tracks no prepared statements, as
// Debian's 1.18 cannot (max_prepared_statements = 0 from 1.21 on). It runs
// as the postgres OS user when the test runs as root. It is stopped when t
// ends and its directory removed unless t failed. The test fails when
// pgbouncer is not installed.
func StartPgBouncer(t testing.TB, upstreamURL string) *PgBouncer {
	t.Helper()
	up, err := pgconn.ParseConfig(upstreamURL)
	if err != nil {
		t.Fatalf("PgBouncer's upstream URL: %v", err)
	}
	// Fallbacks also hold the plain-text retry of sslmode=prefer (the
	// default), to the same host.
	for _, f := range up.Fallbacks {
		if f.Host != up.Host || f.Port != up.Port {
			t.Fatalf("PgBouncer's upstream URL names %s:%d and %s:%d; a private PgBouncer has one upstream server", up.Host, up.Port, f.Host, f.Port)
		}
	}
	bin, ok := pgbouncerBin()
	if !ok {
		t.Fatalf("pgbouncer is neither on PATH nor in /usr/sbin: install it (`make up` does)")
	}
	dir, err := os.MkdirTemp("", "millrace-pgbouncer-")
	if err != nil {
		t.Fatalf("create the private PgBouncer's directory: %v", err)
	}
	b := &PgBouncer{t: t, bin: bin, dir: dir, conf: filepath.Join(dir, "pgbouncer.ini"),
		pidFile: filepath.Join(dir, "pgbouncer.pid"), logFile: filepath.Join(dir, "pgbouncer.log"),
		port: FreePort(t), user: up.User}
	if b.as, err = serverUser(dir); err != nil {
		_ = os.RemoveAll(dir)
		t.Fatalf("PgBouncer does not run as root, and running it as the OS user postgres is not possible: %v", err)
	}
	watch(t, "private PgBouncer", dir, killByPIDFile("KILL", b.pidFile), b.Stop)
	users := filepath.Join(dir, "users.txt")
	conf := fmt.Sprintf(pgbouncerConf, up.Host, up.Port, b.port, b.pidFile, b.logFile, users, up.User, PgBouncerPoolSize)
	if b.version() >= 121 {
		conf += "max_prepared_statements = 0\n" // 1.18 refuses the setting it does not know
	}
	for name, content := range map[string]string{
		b.conf: conf,
		users:  fmt.Sprintf("%s %s\n", quoteAuth(up.User), quoteAuth(up.Password)),
	} {
		if err := os.WriteFile(name, []byte(content), 0o600); err != nil {
			t.Fatalf("configure the private PgBouncer: %v", err)
		}
		if err := b.as.chown(name); err != nil {
			t.Fatalf("configure the private PgBouncer: %v", err)
		}
	}
	b.Start()
	return b
}

// quoteAuth quotes s for an auth_file (in double quotes, a double quote
// doubled), a format no library writes.
func quoteAuth(s string) string {
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

// version returns pgbouncer's version as major*100+minor (118 for 1.18).
func (b *PgBouncer) version() int {
	b.t.Helper()
	out, err := b.as.command(b.bin, "--version").Output()
	var major, minor int
	if err == nil {
		_, err = fmt.Sscanf(string(out), "PgBouncer %d.%d", &major, &minor)
	}
	if err != nil {
		b.t.Fatalf("%s --version: %v\n%s", b.bin, err, out)
	}
	return major*100 + minor
}

// URL returns the URL of database through the pooler, as the upstream
// URL's user, without a password (the pooler trusts its clients).
func (b *PgBouncer) URL(database string) string {
	return (&url.URL{Scheme: "postgres", User: url.User(b.user), Host: fmt.Sprintf("127.0.0.1:%d", b.port),
		Path: "/" + database, RawQuery: "sslmode=disable"}).String()
}

// Start starts the pooler on its port and returns once its admin console
// answers.
func (b *PgBouncer) Start() {
	b.t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	refuseRunning(b.t, b.cmd, "private PgBouncer", b.port)
	began := time.Now()
	b.output.Reset()
	cmd := b.as.command(b.bin, "-q", b.conf) // -q: it logs to its log file only
	cmd.Stdout, cmd.Stderr = &b.output, &b.output
	if err := cmd.Start(); err != nil {
		b.t.Fatalf("start pgbouncer: %v", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	b.cmd, b.done = cmd, done
	deadline := time.Now().Add(time.Minute)
	for {
		_, err := b.Show(context.Background(), "VERSION")
		if err == nil {
			b.t.Logf("private PgBouncer on port %d up after %s", b.port, time.Since(began).Round(time.Millisecond))
			return
		}
		select {
		case <-done:
			b.cmd, b.done = nil, nil
			b.t.Fatalf("private PgBouncer on port %d exited while starting: %v\n%s%s", b.port, cmd.ProcessState, &b.output, b.logTail())
		default:
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("private PgBouncer on port %d does not answer: %v\n%s", b.port, err, b.logTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Stop shuts the pooler down with SHUTDOWN on its admin console, which
// closes every connection at once on every version (SIGTERM waits for
// the clients to leave since 1.23), and returns once it has exited. It does
// nothing when the pooler is not running.
func (b *PgBouncer) Stop() {
	b.t.Helper()
	b.whileRunning(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgconn.Connect(ctx, b.URL("pgbouncer"))
		if err != nil {
			b.t.Fatalf("private PgBouncer on port %d: connect to its admin console to stop it: %v\n%s", b.port, err, b.logTail())
		}
		_, _ = conn.Exec(ctx, "SHUTDOWN").ReadAll() // the answer is the connection closing
		_ = conn.Close(ctx)
		b.waitExit(ctx, "stopped")
	})
}

// Kill kills the pooler with SIGKILL, as a crash would: its clients' and
// servers' connections break. It does nothing when it is not running.
func (b *PgBouncer) Kill() {
	b.t.Helper()
	b.whileRunning(func() {
		// The pooler's own process: when the test runs as root, cmd's is
		// runuser's, which waits for it.
		var pid int
		raw, err := os.ReadFile(b.pidFile)
		if err == nil {
			_, err = fmt.Sscan(string(raw), &pid)
		}
		if err == nil {
			err = syscall.Kill(pid, syscall.SIGKILL)
		}
		if err != nil {
			b.t.Fatalf("private PgBouncer on port %d: kill the process in %s: %v", b.port, b.pidFile, err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		b.waitExit(ctx, "killed")
		// A killed pooler leaves its PID file, which a pooler started later
		// refuses to start over if another process has that PID by then.
		_ = os.Remove(b.pidFile)
	})
}

// whileRunning runs f under mu when the pooler runs.
func (b *PgBouncer) whileRunning(f func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.runningLocked() {
		f()
	}
}

// runningLocked reports whether the pooler runs, forgetting it if it has
// exited on its own; b.mu is held.
func (b *PgBouncer) runningLocked() bool {
	if b.cmd == nil {
		return false
	}
	select {
	case <-b.done:
		b.t.Logf("private PgBouncer on port %d had exited: %v\n%s", b.port, b.cmd.ProcessState, b.logTail())
		b.cmd, b.done = nil, nil
		return false
	default:
		return true
	}
}

// waitExit waits until the pooler has exited; b.mu is held.
func (b *PgBouncer) waitExit(ctx context.Context, what string) {
	b.t.Helper()
	select {
	case <-b.done:
	case <-ctx.Done():
		b.t.Fatalf("private PgBouncer on port %d did not exit: %v\n%s", b.port, ctx.Err(), b.logTail())
	}
	b.cmd, b.done = nil, nil
	b.t.Logf("private PgBouncer on port %d %s", b.port, what)
}

// Show runs SHOW what (POOLS, SERVERS, CLIENTS, STATS, ...) on the
// pooler's admin console and returns its rows, each mapping a column's
// name to its value as text ("" for NULL).
func (b *PgBouncer) Show(ctx context.Context, what string) ([]map[string]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// The admin console speaks the simple query protocol only: pgconn's
	// Exec, not pgx's Query.
	conn, err := pgconn.Connect(ctx, b.URL("pgbouncer"))
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	results, err := conn.Exec(ctx, "SHOW "+what).ReadAll()
	if err != nil {
		return nil, err
	}
	var rows []map[string]string
	for _, r := range results {
		for _, values := range r.Rows {
			row := make(map[string]string, len(values))
			for i, f := range r.FieldDescriptions {
				row[f.Name] = string(values[i])
			}
			rows = append(rows, row)
		}
	}
	return rows, nil
}

// logTail returns the end of the pooler's log.
func (b *PgBouncer) logTail() string {
	logs, _ := os.ReadFile(b.logFile)
	return tail(string(logs), 3000)
}
