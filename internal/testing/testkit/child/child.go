package child

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

const (
	// roleEnv hands the child its role.
	roleEnv = "MILLRACE_TESTKIT_CHILD_ROLE"
	// readyLine is the stdout line Ready prints.
	readyLine = "MILLRACE_TESTKIT_CHILD_READY"
)

// Role is the role Start gave this process, "" when go test started it.
func Role() string { return os.Getenv(roleEnv) }

// Ready tells the parent that the child has reached the point WaitReady
// waits for.
func Ready() { fmt.Println(readyLine) }

// Options configure Start.
type Options struct {
	// Role is the child's role, what Role returns in it. Required.
	Role string
	// Env is KEY=VALUE pairs added to the parent's environment.
	Env []string
	// Run is the -test.run pattern: a test that plays the role, or "^$"
	// (the default) when TestMain dispatches on Role.
	Run string
	// Stdout receives the child's stdout, the ready line excepted. Defaults
	// to nothing.
	Stdout io.Writer
	// Stderr receives the child's stderr. Defaults to os.Stderr.
	Stderr io.Writer
}

// Process is a running child.
type Process struct {
	t     testing.TB
	role  string
	cmd   *exec.Cmd
	ready chan struct{}
	done  chan struct{}
	err   error // how the child exited; set before done is closed
}

// Start runs the test binary again as a child playing o.Role. The child is
// killed when t ends, if it still runs.
func Start(t testing.TB, o Options) *Process {
	t.Helper()
	if o.Role == "" {
		t.Fatalf("child.Start: no role")
	}
	run := o.Run
	if run == "" {
		run = "^$"
	}
	cmd := exec.Command(os.Args[0], "-test.run="+run, "-test.count=1")
	cmd.Env = append(append(os.Environ(), o.Env...), roleEnv+"="+o.Role)
	cmd.Stderr = o.Stderr
	if cmd.Stderr == nil {
		cmd.Stderr = os.Stderr
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatalf("child %s: %v", o.Role, err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start child %s: %v", o.Role, err)
	}
	p := &Process{t: t, role: o.Role, cmd: cmd, ready: make(chan struct{}), done: make(chan struct{})}
	out := o.Stdout
	if out == nil {
		out = io.Discard
	}
	go func() {
		var once sync.Once
		scanner := bufio.NewScanner(stdout)
		for scanner.Scan() {
			if strings.TrimSpace(scanner.Text()) == readyLine {
				once.Do(func() { close(p.ready) })
				continue
			}
			fmt.Fprintln(out, scanner.Text())
		}
		_, _ = io.Copy(out, stdout) // after a line too long for the scanner
		// cmd.Wait closes the pipe: read it to the end first.
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(p.Kill)
	return p
}

// WaitReady waits until the child prints the ready line, and fails the
// test when the child exits first or timeout passes.
func (p *Process) WaitReady(timeout time.Duration) {
	p.t.Helper()
	select {
	case <-p.ready:
	case <-p.done:
		p.t.Fatalf("child %s exited (%v) before it was ready", p.role, p.err)
	case <-time.After(timeout):
		p.t.Fatalf("child %s not ready after %s", p.role, timeout)
	}
}

// Done is closed once the child has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err is how the child exited (nil for exit status 0); call it once Done
// is closed.
func (p *Process) Err() error { return p.err }

// Wait waits until the child has exited and returns Err.
func (p *Process) Wait() error {
	<-p.done
	return p.err
}

// Pid is the child's process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Kill sends SIGKILL and waits until the child has exited. It does nothing
// when the child has exited already.
func (p *Process) Kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Stop sends SIGTERM and waits until the child exits, at most limit; then
// it kills the child and says so. It returns how the child exited.
func (p *Process) Stop(limit time.Duration) error {
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("child %s: SIGTERM: %w", p.role, err)
	}
	select {
	case <-p.done:
		return p.err
	case <-time.After(limit):
		p.Kill()
		return fmt.Errorf("child %s still running %s after SIGTERM: killed", p.role, limit)
	}
}

// KilledBySIGKILL reports whether the child ended by SIGKILL (its own or
// Kill's); call it once Done is closed.
func (p *Process) KilledBySIGKILL() bool {
	var ee *exec.ExitError
	if !errors.As(p.err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}
