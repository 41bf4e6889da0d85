package devstack

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeListenEnv makes the test binary a fake server instead of running
// tests: it listens on the address and greets every connection with a NATS
// INFO line (JetStream on when fakeJetStreamEnv is "true").
const fakeListenEnv, fakeJetStreamEnv = "MILLRACE_FAKE_LISTEN", "MILLRACE_FAKE_JETSTREAM"

func TestMain(m *testing.M) {
	if addr := os.Getenv(fakeListenEnv); addr != "" {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		serve(l, os.Getenv(fakeJetStreamEnv) == "true")
	}
	os.Exit(m.Run())
}

// serve greets each connection with an INFO line, as nats-server does.
func serve(l net.Listener, jetstream bool) {
	info := `INFO {"server_id":"fake","version":"2.9.11","proto":1}` + "\r\n"
	if jetstream {
		info = `INFO {"server_id":"fake","version":"2.11.0","proto":1,"jetstream":true}` + "\r\n"
	}
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			_, _ = c.Write([]byte(info))
			_, _ = bufio.NewReader(c).ReadString('\n')
		}()
	}
}

// listen starts an in-test fake server and returns its port.
func listen(t *testing.T, jetstream bool) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	go serve(l, jetstream)
	return l.Addr().(*net.TCPAddr).Port
}

// closedPort returns a loopback port nothing listens on.
func closedPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	return port
}

// stack is one run environment for stack.sh: a PATH of only the basic
// tools the script needs (no GNU timeout, no servers, no installers) plus
// the fakes a test writes into bin.
type stack struct {
	t        *testing.T
	bin, dir string
	env      []string
}

func newStack(t *testing.T, ports map[string]int) *stack {
	t.Helper()
	s := &stack{t: t, bin: t.TempDir(), dir: t.TempDir()}
	for _, tool := range []string{"bash", "env", "mkdir", "touch", "grep", "cat", "id", "sleep", "nohup", "ls", "sort", "tail", "head", "kill", "pwd", "rm", "mv", "chmod"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			continue // a shell builtin on this system
		}
		require.NoError(t, os.Symlink(p, filepath.Join(s.bin, tool)))
	}
	s.env = []string{"PATH=" + s.bin, "HOME=" + s.dir, "MILLRACE_STACK_DIR=" + filepath.Join(s.dir, "state"),
		"FAKE_LOG=" + filepath.Join(s.dir, "calls.log")}
	for name, port := range ports {
		s.env = append(s.env, "MILLRACE_STACK_"+name+"_PORT="+strconv.Itoa(port))
	}
	return s
}

// fake writes an executable script named name into the stack's PATH.
func (s *stack) fake(name, body string) {
	s.t.Helper()
	bash, err := exec.LookPath("bash")
	require.NoError(s.t, err)
	path := filepath.Join(s.bin, name)
	require.NoError(s.t, os.RemoveAll(path)) // never write through a symlink to a real tool
	script := "#!" + bash + "\necho \"" + name + " $*\" >>\"$FAKE_LOG\"\n" + body + "\n"
	require.NoError(s.t, os.WriteFile(path, []byte(script), 0o755))
}

// run runs stack.sh with args and returns its combined output and error.
func (s *stack) run(args ...string) (string, error) {
	s.t.Helper()
	cmd := exec.Command("./stack.sh", args...)
	cmd.Env = s.env
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// calls returns what the fakes were called with, one call per line.
func (s *stack) calls() string {
	b, err := os.ReadFile(filepath.Join(s.dir, "calls.log"))
	if os.IsNotExist(err) {
		return ""
	}
	require.NoError(s.t, err)
	return string(b)
}

func TestReusedNATSWithoutJetStreamIsRefused(t *testing.T) {
	t.Parallel()
	s := newStack(t, map[string]int{"NATS": listen(t, false)})
	out, err := s.run("up", "nats")
	require.Error(t, err, out)
	require.Contains(t, out, "has no JetStream")
	require.Contains(t, out, "systemctl disable --now nats-server", "the message says how to get the port back")
	require.NotContains(t, out, "reused")
}

func TestReusedNATSWithJetStreamNeedsNoTimeoutCommand(t *testing.T) {
	t.Parallel()
	s := newStack(t, map[string]int{"NATS": listen(t, true), "PG": closedPort(t), "AMQP": listen(t, false)})
	_, err := exec.Command("env", "PATH="+s.bin, "bash", "-c", "command -v timeout").Output()
	require.Error(t, err, "the test's PATH has no timeout command")

	out, err := s.run("up", "nats")
	require.NoError(t, err, out)
	require.Contains(t, out, "reused the server on 127.0.0.1:")
	require.Contains(t, out, "(JetStream on)")

	out, err = s.run("status")
	require.NoError(t, err, out)
	require.Regexp(t, `postgresql +down`, out)
	require.Regexp(t, `rabbitmq +up on 127\.0\.0\.1:\d+`, out)
	require.Regexp(t, `nats +up on 127\.0\.0\.1:\d+`, out)
}

func TestMacOSInstallsAndStartsWithHomebrew(t *testing.T) {
	t.Parallel()
	pg, amqp := closedPort(t), closedPort(t)
	s := newStack(t, map[string]int{"PG": pg, "AMQP": amqp})
	self, err := os.Executable()
	require.NoError(t, err)
	s.fake("uname", `echo Darwin`)
	s.fake("psql", ``)
	// brew: install does nothing; services start runs a fake server on
	// the formula's port (this test binary), services stop kills it.
	s.fake("brew", fmt.Sprintf(`
case "$1 $2" in
"services start")
	case "$3" in postgresql@16) port=%d ;; rabbitmq) port=%d ;; *) exit 1 ;; esac
	%s=127.0.0.1:$port nohup %q >/dev/null 2>&1 &
	echo $! >"$FAKE_LOG.$3.pid" ;;
"services stop")
	kill "$(cat "$FAKE_LOG.$3.pid")" ;;
esac`, pg, amqp, fakeListenEnv, self))
	t.Cleanup(func() {
		for _, f := range []string{"postgresql@16", "rabbitmq"} {
			if b, err := os.ReadFile(filepath.Join(s.dir, "calls.log."+f+".pid")); err == nil {
				if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
					if p, err := os.FindProcess(pid); err == nil {
						_ = p.Kill()
					}
				}
			}
		}
	})

	out, err := s.run("up", "postgres", "rabbitmq")
	require.NoError(t, err, out)
	require.Contains(t, out, "started PostgreSQL (Homebrew) on 127.0.0.1:"+strconv.Itoa(pg))
	require.Contains(t, out, "started RabbitMQ (Homebrew) on 127.0.0.1:"+strconv.Itoa(amqp))
	calls := s.calls()
	for _, want := range []string{"brew install -q postgresql@16", "brew services start postgresql@16",
		"brew install -q rabbitmq", "brew services start rabbitmq", "CREATE ROLE postgres SUPERUSER LOGIN PASSWORD 'postgres'"} {
		require.Contains(t, calls, want)
	}
	require.NotContains(t, calls, "apt-get")

	out, err = s.run("down")
	require.NoError(t, err, out)
	calls = s.calls()
	require.Contains(t, calls, "brew services stop postgresql@16")
	require.Contains(t, calls, "brew services stop rabbitmq")
	requirePortClosed(t, amqp, "down stopped the service it started")
}

func TestLinuxWithoutInstallerNamesWhatToInstall(t *testing.T) {
	t.Parallel()
	s := newStack(t, map[string]int{"AMQP": closedPort(t)})
	s.fake("uname", `echo Linux`)
	out, err := s.run("up", "rabbitmq")
	require.Error(t, err, out)
	require.Contains(t, out, "rabbitmq-server is not installed and apt-get is not available")
}

// A nats-server that starts but has no JetStream (an old or odd build) is
// an error, not "started with JetStream"; one that has it is stopped by down.
func TestStartedNATSIsCheckedForJetStream(t *testing.T) {
	t.Parallel()
	self, err := os.Executable()
	require.NoError(t, err)
	for _, jetstream := range []bool{false, true} {
		t.Run(fmt.Sprintf("jetstream=%v", jetstream), func(t *testing.T) {
			t.Parallel()
			port := closedPort(t)
			s := newStack(t, map[string]int{"NATS": port})
			s.fake("uname", `echo Linux`)
			s.fake("nats-server", fmt.Sprintf(`%s=127.0.0.1:%d %s=%v exec %q`, fakeListenEnv, port, fakeJetStreamEnv, jetstream, self))
			out, err := s.run("up", "nats")
			t.Cleanup(func() { _, _ = s.run("down") })
			require.Contains(t, s.calls(), "nats-server -a 127.0.0.1 -p "+strconv.Itoa(port)+" -js")
			if !jetstream {
				require.Error(t, err, out)
				require.Contains(t, out, "reports no JetStream")
				return
			}
			require.NoError(t, err, out)
			require.Contains(t, out, "started nats-server with JetStream")
			out, err = s.run("down")
			require.NoError(t, err, out)
			require.Contains(t, out, "nats        stopped")
			requirePortClosed(t, port, "down stopped the nats-server it started")
		})
	}
}

func TestUnknownServiceIsAnError(t *testing.T) {
	t.Parallel()
	s := newStack(t, nil)
	out, err := s.run("up", "kafka")
	require.Error(t, err)
	require.Contains(t, out, "unknown service kafka")
}

// Debian's pgbouncer package is installed with every service start refused
// (its maintainer scripts would start a system-wide pgbouncer) and its
// service disabled at boot; a policy-rc.d already there is kept as it was,
// also when the install fails.
func TestPgBouncerIsInstalledWithoutItsService(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, policy string // the policy-rc.d there before ("": none)
		aptFails     bool
	}{
		{name: "no policy"},
		{name: "refusing policy", policy: "#!/bin/sh\nexit 101\n"},
		{name: "permissive policy", policy: "#!/bin/sh\nexit 0\n"},
		{name: "permissive policy, failed install", policy: "#!/bin/sh\nexit 0\n", aptFails: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newStack(t, nil)
			policy, bin := filepath.Join(s.dir, "policy-rc.d"), filepath.Join(s.dir, "sbin", "pgbouncer")
			s.env = append(s.env, "MILLRACE_STACK_POLICY_RC_D="+policy, "MILLRACE_STACK_PGBOUNCER="+bin)
			if tc.policy != "" {
				require.NoError(t, os.WriteFile(policy, []byte(tc.policy), 0o755))
			}
			s.fake("uname", `echo Linux`)
			s.fake("sudo", `exec "$@"`)
			s.fake("update-rc.d", ``)
			// apt-get install records what policy-rc.d says of starting
			// pgbouncer, then installs a fake binary where Debian's goes.
			s.fake("apt-get", fmt.Sprintf(`
[ "$1" = install ] || exit 0
"$MILLRACE_STACK_POLICY_RC_D" pgbouncer start; echo "policy says $?" >>"$FAKE_LOG"
%v && exit 1
mkdir -p %q && printf '#!/bin/sh\necho PgBouncer 1.18.0\n' >%q && chmod 755 %[3]q`, tc.aptFails, filepath.Dir(bin), bin))

			out, err := s.run("status")
			require.NoError(t, err, out)
			require.Regexp(t, `pgbouncer +missing \(make up installs it\)`, out)

			out, err = s.run("up", "pgbouncer")
			calls := s.calls()
			require.Contains(t, calls, "apt-get install -y -qq pgbouncer")
			require.Contains(t, calls, "policy says 101", "the install ran with service starts allowed")
			kept, readErr := os.ReadFile(policy)
			if tc.policy == "" {
				require.True(t, os.IsNotExist(readErr), "the policy-rc.d written for the install is still there")
			} else {
				require.NoError(t, readErr, "the policy-rc.d that was there is gone")
				require.Equal(t, tc.policy, string(kept))
			}
			if tc.aptFails {
				require.Error(t, err, out)
				require.NotContains(t, calls, "update-rc.d")
				return
			}
			require.NoError(t, err, out)
			require.Contains(t, out, "installed "+bin+" (PgBouncer 1.18.0); its system service neither started nor enabled")
			require.Contains(t, calls, "update-rc.d pgbouncer disable")

			out, err = s.run("status")
			require.NoError(t, err, out)
			require.Regexp(t, `pgbouncer +installed`, out)
			out, err = s.run("up", "pgbouncer")
			require.NoError(t, err, out)
			require.Contains(t, out, "found "+bin)
			require.Equal(t, 1, strings.Count(s.calls(), "apt-get install"), "installed twice")
		})
	}
}

// A NATS server of 2.11 or later on the NATS port needs no current one
// beside it.
func TestCurrentNATSIsNotNeededBesideARecentOne(t *testing.T) {
	t.Parallel()
	s := newStack(t, map[string]int{"NATS": listen(t, true), "NATS_CURRENT": closedPort(t)})
	s.fake("uname", `echo Linux`)
	out, err := s.run("up", "nats-current")
	require.NoError(t, err, out)
	require.Contains(t, out, "not needed: the server on 127.0.0.1:")
	require.Contains(t, out, "is 2.11.0, not older than 2.11")
	require.Empty(t, s.calls(), "nothing built or started")
}

// Beside an older NATS server (2.9.11 on the NATS port), up builds
// nats-server at go.mod's version from the Go module into the cache, starts
// it on its own port and data directory, and says so; down stops it.
func TestCurrentNATSIsBuiltAndStartedBesideAnOldOne(t *testing.T) {
	t.Parallel()
	self, err := os.Executable()
	require.NoError(t, err)
	port := closedPort(t)
	s := newStack(t, map[string]int{"NATS": listen(t, false), "NATS_CURRENT": port})
	s.fake("uname", `echo Linux`)
	built := filepath.Join(s.dir, "built-nats-server")
	require.NoError(t, os.WriteFile(built, fmt.Appendf(nil, "#!/usr/bin/env bash\n"+
		"if [ \"$1\" = --version ]; then echo 'nats-server: v2.15.2'; exit; fi\n"+
		"echo \"nats-server $*\" >>\"$FAKE_LOG\"\n%s=127.0.0.1:%d %s=true exec %q\n",
		fakeListenEnv, port, fakeJetStreamEnv, self), 0o755))
	s.fake("go", fmt.Sprintf(`case "$1" in
list) echo v2.15.2 ;;
env) echo linux ;;
build) cat %q >"$3" && chmod +x "$3" ;;
esac`, built))
	out, err := s.run("up", "nats-current")
	t.Cleanup(func() { _, _ = s.run("down") })
	require.NoError(t, err, out)
	require.Contains(t, out, "building nats-server v2.15.2 from the Go module (github.com/nats-io/nats-server/v2@v2.15.2)")
	require.Contains(t, out, "started nats-server v2.15.2 with JetStream on 127.0.0.1:"+strconv.Itoa(port))
	require.Contains(t, out, "is 2.9.11, older than 2.11")
	require.Contains(t, s.calls(), "go build -o "+filepath.Join(s.dir, ".cache", "millrace", "nats-server", "v2.15.2-linux-linux"))
	require.Contains(t, s.calls(), "nats-server -a 127.0.0.1 -p "+strconv.Itoa(port)+" -js -sd ")

	out, err = s.run("status")
	require.NoError(t, err, out)
	require.Regexp(t, `nats-current up on 127\.0\.0\.1:\d+ \(nats-server 2\.11\.0\)`, out)
	out, err = s.run("down")
	require.NoError(t, err, out)
	require.Contains(t, out, "nats-current stopped")
	requirePortClosed(t, port, "down stopped the nats-server it started")
}

// requirePortClosed waits until nothing listens on the local port any
// more: what says what should have stopped it.
func requirePortClosed(t *testing.T, port int, what string) {
	t.Helper()
	require.Eventually(t, func() bool {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), time.Second)
		if err == nil {
			_ = c.Close()
		}
		return err != nil
	}, 10*time.Second, 50*time.Millisecond, what)
}

// up postgres says how to turn on wal_level = logical for the WAL relay,
// after reading the setting only: it changes nothing on the server.
func TestPostgresUpAdvisesOnLogicalWAL(t *testing.T) {
	t.Parallel()
	for level, want := range map[string]string{
		"replica": "wal_level = replica; relay.source: wal needs logical: ALTER SYSTEM SET wal_level = logical",
		"logical": "wal_level = logical: relay.source: wal can run here",
		"":        "relay.source: wal needs wal_level = logical: ALTER SYSTEM SET wal_level = logical",
	} {
		s := newStack(t, map[string]int{"PG": listen(t, false)})
		s.fake("psql", "echo "+level)
		out, err := s.run("up", "postgres")
		require.NoError(t, err, out)
		require.Contains(t, out, "reused the server", level)
		require.Contains(t, out, want, level)
		require.Contains(t, s.calls(), "psql postgres://postgres:postgres@127.0.0.1:")
		require.NotContains(t, s.calls(), "ALTER", "make up changed a setting")
	}
}
