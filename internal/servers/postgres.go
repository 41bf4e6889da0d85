package servers

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"os/user"
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
	runAs   string // OS user to run PostgreSQL's programs as; "" for this process's
	uid     int    // runAs's user and group ids
	gid     int
	runuser string
	dir     string
	data    string
	logFile string
	port    int
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
	return startPostgreSQL(t, "", "")
}

// StartPostgreSQLWithTLS is StartPostgreSQL with TLS on (ssl = on), the
// server presenting the certificate and key in certFile and keyFile.
// Clients may still connect without TLS.
func StartPostgreSQLWithTLS(t testing.TB, certFile, keyFile string) *PostgreSQL {
	t.Helper()
	return startPostgreSQL(t, certFile, keyFile)
}

func startPostgreSQL(t testing.TB, certFile, keyFile string) *PostgreSQL {
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
	if os.Geteuid() == 0 {
		p.runAs = "postgres"
		if err := p.chownToRunAs(); err != nil {
			_ = os.RemoveAll(dir)
			t.Fatalf("PostgreSQL does not run as root, and running it as the OS user postgres is not possible: %v", err)
		}
	}
	watch(t, "private PostgreSQL cluster", dir,
		p.shellCommand("pg_ctl", "-D", p.data, "stop", "-m", "immediate", "-w")+" >/dev/null 2>&1", p.Stop)

	began := time.Now()
	p.run("initdb", "-D", p.data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-locale", "--no-sync")
	conf := fmt.Sprintf(`
listen_addresses = '127.0.0.1'
port = %d
unix_socket_directories = '%s'
fsync = off
max_connections = 200
`, p.port, p.data)
	if certFile != "" {
		// server.crt and server.key in the data directory are PostgreSQL's
		// defaults; the key must belong to the server's user, mode 0600.
		for dst, src := range map[string]string{"server.crt": certFile, "server.key": keyFile} {
			if err := p.copyIn(src, dst); err != nil {
				t.Fatalf("give the private PostgreSQL cluster its TLS files: %v", err)
			}
		}
		conf += "ssl = on\n"
	}
	f, err := os.OpenFile(filepath.Join(p.data, "postgresql.conf"), os.O_WRONLY|os.O_APPEND, 0)
	if err == nil {
		_, err = f.WriteString(conf)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		t.Fatalf("configure the private PostgreSQL cluster: %v", err)
	}
	t.Logf("private PostgreSQL cluster on port %d made by initdb in %s", p.port, time.Since(began).Round(time.Millisecond))
	p.Start()
	return p
}

// chownToRunAs hands the cluster's directory to the runAs user and finds
// runuser to run PostgreSQL's programs as that user.
func (p *PostgreSQL) chownToRunAs() error {
	u, err := user.Lookup(p.runAs)
	if err != nil {
		return err
	}
	uid, err := strconv.Atoi(u.Uid)
	if err != nil {
		return err
	}
	gid, err := strconv.Atoi(u.Gid)
	if err != nil {
		return err
	}
	if err := os.Chown(p.dir, uid, gid); err != nil {
		return err
	}
	p.uid, p.gid = uid, gid
	for _, c := range []string{"runuser", "/usr/sbin/runuser", "/sbin/runuser"} {
		if path, err := exec.LookPath(c); err == nil {
			p.runuser = path
			return nil
		}
	}
	return fmt.Errorf("runuser not found")
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
	if p.runAs != "" {
		return os.Chown(dst, p.uid, p.gid)
	}
	return nil
}

// command returns the command that runs PostgreSQL's program name with args,
// as the runAs user when there is one.
func (p *PostgreSQL) command(name string, args ...string) *exec.Cmd {
	path := filepath.Join(p.bin, name)
	if p.runAs == "" {
		return exec.Command(path, args...)
	}
	return exec.Command(p.runuser, append([]string{"-u", p.runAs, "--", path}, args...)...)
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
	began := time.Now()
	p.Crash()
	p.Start()
	p.t.Logf("private PostgreSQL cluster on port %d crash-restarted in %s", p.port, time.Since(began).Round(time.Millisecond))
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
