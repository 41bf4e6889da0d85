package servers

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// FreePort returns a TCP port on 127.0.0.1 that nothing listens on right now.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("find a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
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
