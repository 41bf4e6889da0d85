package servers

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATS is a nats-server of its own, with JetStream, listening on its own
// port and keeping its streams in its own store directory, that a test may
// stop, kill and restart without touching the shared server other tests use.
type NATS struct {
	// URL is the server's client URL, the same across restarts.
	URL string

	t         testing.TB
	bin       string
	dir       string
	port      int
	pidFile   string
	logFile   string
	host      string   // the address it listens on
	netns     *Netns   // the network namespace it runs in, nil: the host's
	args      []string // more nats-server flags (a cluster node's name and routes)
	clustered bool     // a cluster node: JetStream answers only once the cluster has quorum

	mu   sync.Mutex
	cmd  *exec.Cmd     // the running server, nil when stopped
	done chan struct{} // closed once cmd has exited
	// supervise starts the server again whenever it exits on its own (it
	// was killed from outside, see RestartCommand).
	supervise bool
}

// StartNATS starts a private nats-server with JetStream on a free port of
// 127.0.0.1 and returns once a client connects and JetStream answers. It is
// stopped when t ends and its store directory removed unless t failed. Its
// binary is built from the nats-server module at the version go.mod
// requires (see natsServerBin); the test fails when that build fails.
func StartNATS(t testing.TB) *NATS {
	t.Helper()
	s := newNATS(t)
	s.Start()
	return s
}

// newNATS prepares a private server (port, directory, cleanup) without
// starting it.
func newNATS(t testing.TB) *NATS {
	t.Helper()
	return newNATSIn(t, nil)
}

// newNATSIn prepares a private server that runs in ns (listening on
// ns.NodeIP), or on the host's 127.0.0.1 when ns is nil.
func newNATSIn(t testing.TB, ns *Netns) *NATS {
	t.Helper()
	bin := natsServerBin(t)
	dir, err := os.MkdirTemp("", "millrace-nats-")
	if err != nil {
		t.Fatalf("create the private NATS server's directory: %v", err)
	}
	s := &NATS{
		t:       t,
		bin:     bin,
		dir:     dir,
		host:    "127.0.0.1",
		netns:   ns,
		port:    FreePort(t),
		pidFile: filepath.Join(dir, "nats.pid"),
		logFile: filepath.Join(dir, "nats.log"),
	}
	if ns != nil {
		s.host = ns.NodeIP
	}
	s.URL = fmt.Sprintf("nats://%s:%d", s.host, s.port)
	watch(t, "private NATS server", dir, killByPIDFile("KILL", s.pidFile), s.Stop)
	return s
}

// Start starts the server on its port and store directory (streams stored
// before survive) and returns once a client connects and JetStream answers.
func (s *NATS) Start() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	refuseRunning(s.t, s.cmd, "private NATS server", s.port)
	if err := s.startLocked(); err != nil {
		s.t.Fatalf("%v", err)
	}
}

// startLocked starts the server and waits until it answers; s.mu is held.
func (s *NATS) startLocked() error {
	began := time.Now()
	logs, err := os.OpenFile(s.logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("open the private NATS server's log: %w", err)
	}
	args := append([]string{"-js", "-sd", s.StoreDir(),
		"-a", s.host, "-p", strconv.Itoa(s.port), "-P", s.pidFile}, s.args...)
	cmd := exec.Command(s.bin, args...)
	if s.netns != nil {
		cmd = s.netns.Command(s.bin, args...)
	}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		logs.Close()
		return fmt.Errorf("start nats-server: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logs.Close()
		close(done)
		s.restartIfSupervised(cmd)
	}()
	s.cmd, s.done = cmd, done

	deadline := time.Now().Add(time.Minute)
	for {
		err := s.ping(!s.clustered) // a cluster node has JetStream only once the cluster has quorum
		if err == nil {
			s.t.Logf("private NATS server on port %d up after %s", s.port, time.Since(began).Round(time.Millisecond))
			return nil
		}
		select {
		case <-done:
			s.cmd, s.done = nil, nil
			return fmt.Errorf("private NATS server on port %d exited while starting: %v\n%s", s.port, cmd.ProcessState, s.logTail())
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("private NATS server on port %d did not start: %w\n%s", s.port, err, s.logTail())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// restartIfSupervised starts the server again when cmd, which has exited,
// is still the running server (no Stop or Kill ended it) and RestartCommand
// asked for supervision.
func (s *NATS) restartIfSupervised(cmd *exec.Cmd) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.supervise || s.cmd != cmd {
		return
	}
	s.cmd, s.done = nil, nil
	if err := s.startLocked(); err != nil {
		s.t.Errorf("supervised restart: %v", err)
	}
}

// RestartCommand is a shell command that kills the server (SIGKILL); from
// the first call on, the server is started again on the same port and
// store directory whenever it exits other than by Stop or Kill. It is what
// Watermill's suite runs to restart a service.
func (s *NATS) RestartCommand() []string {
	s.mu.Lock()
	s.supervise = true
	s.mu.Unlock()
	return []string{"/bin/sh", "-c", fmt.Sprintf(`kill -9 "$(cat %s)"`, shellQuote(s.pidFile))}
}

// ping connects to the server and, with jetStream, asks JetStream for the
// account's info.
func (s *NATS) ping(jetStream bool) error {
	nc, err := nats.Connect(s.URL, nats.Timeout(time.Second), nats.NoReconnect())
	if err != nil {
		return err
	}
	defer nc.Close()
	if !jetStream {
		return nil
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	return err
}

// Stop stops the server (SIGTERM, a clean shutdown) and waits for its
// process to end. It does nothing when the server is not running.
func (s *NATS) Stop() {
	s.t.Helper()
	s.signal(syscall.SIGTERM, "stopped")
}

// Kill kills the server (SIGKILL, no shutdown at all) and waits for its
// process to end. It does nothing when the server is not running.
func (s *NATS) Kill() {
	s.t.Helper()
	s.signal(syscall.SIGKILL, "killed")
}

// Pause freezes the server (SIGSTOP): its sockets stay open but it answers
// nothing, as a hung node does. Resume wakes it.
func (s *NATS) Pause() { s.t.Helper(); s.freeze(syscall.SIGSTOP, "paused") }

// Resume wakes a paused server (SIGCONT).
func (s *NATS) Resume() { s.t.Helper(); s.freeze(syscall.SIGCONT, "resumed") }

func (s *NATS) freeze(sig syscall.Signal, what string) {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		s.t.Fatalf("private NATS server on port %d: %s while it is not running", s.port, what)
	}
	if err := s.cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("signal the private NATS server: %v", err)
	}
	s.t.Logf("private NATS server on port %d %s", s.port, what)
}

// StoreDir is the server's JetStream store directory, the same across
// restarts. A test may change it while the server is stopped, e.g. remove
// a consumer's state to stand for state a crash kept from reaching disk.
func (s *NATS) StoreDir() string { return filepath.Join(s.dir, "store") }

// Restart stops the server and starts it again on the same port and store
// directory.
func (s *NATS) Restart() {
	s.t.Helper()
	restart(s.t, fmt.Sprintf("private NATS server on port %d", s.port), "restarted", s.Stop, s.Start)
}

// signal sends sig to the running server and waits for it to exit; a server
// still running a minute after SIGTERM is killed.
func (s *NATS) signal(sig syscall.Signal, what string) {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	began := time.Now()
	_ = s.cmd.Process.Signal(syscall.SIGCONT) // a paused server handles nothing else
	if err := s.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		s.t.Errorf("signal the private NATS server: %v", err)
	}
	select {
	case <-s.done:
	case <-time.After(time.Minute):
		s.t.Errorf("private NATS server on port %d still running a minute after %v: killing it", s.port, sig)
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	s.cmd, s.done = nil, nil
	_ = os.Remove(s.pidFile)
	s.t.Logf("private NATS server on port %d %s after %s", s.port, what, time.Since(began).Round(time.Millisecond))
}

// logTail returns the end of the server's log.
func (s *NATS) logTail() string {
	logs, _ := os.ReadFile(s.logFile)
	return tail(string(logs), 3000)
}

// natsServerModule is the module the private servers' binary is built
// from, at the version go.mod requires (the one package natsdev links).
const natsServerModule = "github.com/nats-io/nats-server/v2"

// natsBuildTimeout bounds building the binary, waiting for another test
// process's build included: on a busy 2-core machine, with the standard
// library compiled and the modules to download, about three minutes; with
// an empty build cache at a load average near 38, more than ten.
const natsBuildTimeout = 20 * time.Minute

var natsBin struct {
	once sync.Once
	path string
	err  error
}

// natsServerBin returns the nats-server binary private servers run:
// NATS_SERVER_BIN when set, else one built from the nats-server module at
// the version go.mod requires, once per test process and cached between
// runs. A failed build fails the test; no other binary is tried.
func natsServerBin(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("NATS_SERVER_BIN"); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("NATS_SERVER_BIN: %v", err)
		}
		return p
	}
	natsBin.once.Do(func() {
		began := time.Now()
		natsBin.path, natsBin.err = buildNATSServer()
		if natsBin.err == nil {
			t.Logf("nats-server binary %s ready after %s", natsBin.path, time.Since(began).Round(time.Millisecond))
		}
	})
	if natsBin.err != nil {
		t.Fatalf("build nats-server from %s: %v", natsServerModule, natsBin.err)
	}
	return natsBin.path
}

// buildNATSServer builds the binary into a cache directory named by the
// module's version, unless a binary of that version is there already. A
// lock file serialises test processes building at once; the binary is
// built under a temporary name and renamed, so nothing ever runs a
// half-written one.
func buildNATSServer() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), natsBuildTimeout)
	defer cancel()
	goBin, err := exec.LookPath("go")
	if err != nil {
		return "", fmt.Errorf("the go command is needed to build it: %w", err)
	}
	version, replaced, err := natsModuleVersion(ctx, goBin)
	if err != nil {
		return "", err
	}
	base, err := os.UserCacheDir()
	if err != nil {
		base = os.TempDir()
	}
	dir := filepath.Join(base, "millrace", "nats-server", version+"-"+runtime.GOOS+"-"+runtime.GOARCH)
	if replaced {
		// A replaced module (a local checkout) may change under the same
		// version: build it afresh in a directory of this process's.
		if dir, err = os.MkdirTemp("", "millrace-nats-server-"); err != nil {
			return "", err
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	unlock, err := lockFile(ctx, filepath.Join(dir, "lock"))
	if err != nil {
		return "", err
	}
	defer unlock()

	bin := filepath.Join(dir, "nats-server")
	if !replaced && binaryVersionIs(ctx, bin, version) {
		return bin, nil
	}
	tmp := fmt.Sprintf("%s.tmp%d", bin, os.Getpid())
	defer os.Remove(tmp)
	build := exec.CommandContext(ctx, goBin, "build", "-o", tmp, natsServerModule)
	build.Dir = moduleRoot()
	if out, err := build.CombinedOutput(); err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("not built within %s: %w", natsBuildTimeout, ctx.Err())
		}
		return "", fmt.Errorf("go build: %w\n%s", err, tail(string(out), 3000))
	}
	if !replaced && !binaryVersionIs(ctx, tmp, version) {
		return "", fmt.Errorf("the built binary does not report version %s", version)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", err
	}
	return bin, nil
}

// natsModuleVersion asks the go command which version of the nats-server
// module the main module requires, and whether a replace directive points
// it elsewhere.
func natsModuleVersion(ctx context.Context, goBin string) (version string, replaced bool, err error) {
	cmd := exec.CommandContext(ctx, goBin, "list", "-m", "-f", "{{.Version}} {{if .Replace}}replaced{{end}}", natsServerModule)
	cmd.Dir = moduleRoot()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", false, fmt.Errorf("go list -m %s: %w\n%s", natsServerModule, err, stderr.String())
	}
	fields := strings.Fields(string(out))
	if len(fields) == 0 {
		return "", false, fmt.Errorf("go list -m %s printed no version", natsServerModule)
	}
	return fields[0], len(fields) > 1, nil
}

// moduleRoot is the directory of millrace's go.mod, found from this source
// file so that the build uses go.mod's versions whatever the working
// directory of the test.
func moduleRoot() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok || !filepath.IsAbs(file) {
		return "" // built with -trimpath: the working directory, inside the module
	}
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

// binaryVersionIs reports whether bin runs and reports version.
func binaryVersionIs(ctx context.Context, bin, version string) bool {
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	return err == nil && strings.TrimSpace(string(out)) == "nats-server: "+version
}

// lockFile takes an exclusive flock on path, polling until ctx ends (a
// blocking flock could not be bounded), and returns its release.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("lock %s: another test process is still building: %w", path, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}
