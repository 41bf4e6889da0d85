package servers

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/user"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// FreePort returns a TCP port on 127.0.0.1 that nothing listens on right now
// and that this process has not handed out before. It picks the port below
// the kernel's ephemeral range: a port from that range (what a listen on
// port 0 gives) can be taken as the source port of any outgoing connection
// before the server binds it, which made a RabbitMQ node, seconds into its
// boot, fail with eaddrinuse.
func FreePort(t testing.TB) int {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	lo, hi := 10000, ephemeralStart()-1
	for range 1000 {
		p := lo + rand.IntN(max(hi-lo, 1))
		if handedOut[p] {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue
		}
		_ = l.Close()
		handedOut[p] = true
		return p
	}
	t.Fatalf("find a free port: none of 1000 tries between %d and %d was free", lo, hi)
	return 0
}

var (
	portsMu   sync.Mutex
	handedOut = map[int]bool{} // ports FreePort returned
)

// ephemeralStart is the first port of the kernel's ephemeral range (Linux's
// default when it cannot be read).
func ephemeralStart() int {
	const linuxDefault = 32768
	raw, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return linuxDefault
	}
	fields := strings.Fields(string(raw))
	if len(fields) == 0 {
		return linuxDefault
	}
	n, err := strconv.Atoi(fields[0])
	if err != nil || n <= 11000 {
		return linuxDefault
	}
	return n
}

// refuseRunning fails t when cmd, the process of what on port, runs: a
// Start while it runs.
func refuseRunning(t testing.TB, cmd *exec.Cmd, what string, port int) {
	t.Helper()
	if cmd != nil {
		t.Fatalf("%s on port %d: Start while it runs", what, port)
	}
}

// tail returns the last n bytes of s.
func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

// shellQuote quotes s as one word for /bin/sh.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// watch makes sure the server whose files are in dir goes away with the
// test: a cleanup runs stop and removes dir (kept when the test failed, for
// its logs); and since cleanups do not run when the test binary dies (a
// -timeout panic), a watchdog shell runs stopScript and removes dir then.
func watch(t testing.TB, what, dir, stopScript string, stop func()) {
	t.Helper()
	watchdog := exec.Command("/bin/sh", "-c", fmt.Sprintf(`
while kill -0 %d 2>/dev/null; do sleep 1; done
%s
rm -rf %s`, os.Getpid(), stopScript, shellQuote(dir)))
	watchdog.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // outlives a killed process group
	if err := watchdog.Start(); err != nil {
		_ = os.RemoveAll(dir)
		t.Fatalf("start the %s's watchdog: %v", what, err)
	}
	t.Cleanup(func() {
		stop()
		_ = watchdog.Process.Kill()
		_ = watchdog.Wait()
		if !t.Failed() {
			_ = os.RemoveAll(dir)
		} else {
			t.Logf("%s's files kept in %s", what, dir)
		}
	})
}

// killByPIDFile is a shell snippet that sends signal to the process whose
// PID is in pidFile, if any, and waits for it to end.
func killByPIDFile(signal, pidFile string) string {
	return fmt.Sprintf(`if [ -f %[1]s ]; then
	pid=$(cat %[1]s)
	kill -%[2]s "$pid"
	while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
fi`, shellQuote(pidFile), signal)
}

// osUser is the OS user a server that refuses to run as root (PostgreSQL,
// PgBouncer) runs as: postgres when the test runs as root, through
// runuser; this process's user otherwise (name "").
type osUser struct {
	name     string
	uid, gid int
	runuser  string
}

// serverUser returns the user to run the server whose files are in dir
// as, and gives dir to that user.
func serverUser(dir string) (osUser, error) {
	if os.Geteuid() != 0 {
		return osUser{}, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return osUser{}, err
	}
	uid, err := strconv.Atoi(u.Uid)
	if err != nil {
		return osUser{}, err
	}
	gid, err := strconv.Atoi(u.Gid)
	if err != nil {
		return osUser{}, err
	}
	as := osUser{name: u.Username, uid: uid, gid: gid}
	if err := as.chown(dir); err != nil {
		return osUser{}, err
	}
	for _, c := range []string{"runuser", "/usr/sbin/runuser", "/sbin/runuser"} {
		if path, err := exec.LookPath(c); err == nil {
			as.runuser = path
			return as, nil
		}
	}
	return osUser{}, fmt.Errorf("runuser not found")
}

// chown gives path to the user; it does nothing for this process's user.
func (u osUser) chown(path string) error {
	if u.name == "" {
		return nil
	}
	return os.Chown(path, u.uid, u.gid)
}

// command returns the command that runs the program at path with args as
// the user.
func (u osUser) command(path string, args ...string) *exec.Cmd {
	if u.name == "" {
		return exec.Command(path, args...)
	}
	return exec.Command(u.runuser, append([]string{"-u", u.name, "--", path}, args...)...)
}
