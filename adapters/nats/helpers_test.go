package nats

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/nats/natsdev"
)

// sharedURL is the NATS server the tests share with everyone else: NATS_URL,
// or the local nats-server. Tests never restart it.
func sharedURL() string {
	if u := os.Getenv("NATS_URL"); u != "" {
		return u
	}
	return "nats://127.0.0.1:4222"
}

// serverBinary is the nats-server executable for private server processes:
// NATS_SERVER_BIN, else nats-server on PATH, else /usr/sbin/nats-server.
func serverBinary() string {
	if p := os.Getenv("NATS_SERVER_BIN"); p != "" {
		return p
	}
	if p, err := exec.LookPath("nats-server"); err == nil {
		return p
	}
	return "/usr/sbin/nats-server"
}

// embeddedSync is the fsync setting of the tests' embedded servers.
const embeddedSync = SyncAlways

// startEmbedded starts an in-process server on a free port with its own
// store directory; it stops with the test.
func startEmbedded(t testing.TB) *natsdev.Server {
	t.Helper()
	srv, err := natsdev.Start("nats://127.0.0.1:0", natsdev.Options{StoreDir: t.TempDir(), Sync: embeddedSync})
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)
	return srv
}

// restartableEmbedded is an embedded server that can be stopped and started
// again on the same port and store directory.
type restartableEmbedded struct {
	mu   sync.Mutex
	srv  *natsdev.Server
	port int
	dir  string
}

func newRestartableEmbedded(t testing.TB) *restartableEmbedded {
	t.Helper()
	r := &restartableEmbedded{port: freePort(t), dir: t.TempDir()}
	r.start(t)
	t.Cleanup(func() { r.mu.Lock(); r.srv.Shutdown(); r.mu.Unlock() })
	return r
}

func (r *restartableEmbedded) start(t testing.TB) {
	t.Helper()
	srv, err := natsdev.Start(fmt.Sprintf("nats://127.0.0.1:%d", r.port), natsdev.Options{StoreDir: r.dir, Sync: embeddedSync})
	require.NoError(t, err, "start the embedded server on port %d", r.port)
	r.srv = srv
}

func (r *restartableEmbedded) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", r.port) }

// Restart shuts the server down and starts it again on the same port and store.
func (r *restartableEmbedded) Restart(t testing.TB) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.srv.Shutdown()
	r.start(t)
}

// serverProcess is a private nats-server process (JetStream, file storage in
// its own directory, a free port) that a test may kill and start again
// without disturbing anyone.
type serverProcess struct {
	t       testing.TB
	port    int
	dir     string
	pidFile string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	// supervise restarts the process whenever it exits, until stopped.
	supervise bool
	stopped   bool
}

// startServerProcess starts a private nats-server process; it is killed when
// the test ends.
func startServerProcess(t testing.TB) *serverProcess {
	t.Helper()
	bin := serverBinary()
	if _, err := os.Stat(bin); err != nil {
		t.Skipf("no nats-server executable at %s (set NATS_SERVER_BIN): this test needs a server process it may restart", bin)
	}
	dir := t.TempDir()
	p := &serverProcess{t: t, port: freePort(t), dir: dir, pidFile: filepath.Join(dir, "pid")}
	p.start()
	t.Cleanup(p.stop)
	return p
}

func freePort(t testing.TB) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func (p *serverProcess) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", p.port) }

func (p *serverProcess) start() {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	require.NoError(p.t, p.startLocked())
}

func (p *serverProcess) startLocked() error {
	cmd := exec.Command(serverBinary(), "-a", "127.0.0.1", "-p", strconv.Itoa(p.port), "-js",
		"-sd", filepath.Join(p.dir, "store"), "-l", filepath.Join(p.dir, "server.log"))
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", serverBinary(), err)
	}
	if err := os.WriteFile(p.pidFile, []byte(strconv.Itoa(cmd.Process.Pid)), 0o600); err != nil {
		return err
	}
	done := make(chan struct{})
	p.cmd, p.done = cmd, done
	go func() {
		_ = cmd.Wait()
		close(done)
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.supervise && !p.stopped && p.cmd == cmd {
			if err := p.startLocked(); err != nil {
				p.t.Errorf("restarting nats-server: %v", err)
			}
		}
	}()
	return waitJetStream(p.URL())
}

// Kill kills the server process (SIGKILL: a crash, no clean shutdown) and
// waits until it has exited.
func (p *serverProcess) Kill() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

// Restart kills the server and starts it again on the same port and store.
func (p *serverProcess) Restart() {
	p.Kill()
	p.start()
}

// RestartCommand is a shell command that kills the current server process;
// supervision brings the server back on the same port and store.
func (p *serverProcess) RestartCommand() []string {
	p.mu.Lock()
	p.supervise = true
	p.mu.Unlock()
	return []string{"sh", "-c", fmt.Sprintf(`kill -9 "$(cat %s)"`, p.pidFile)}
}

func (p *serverProcess) stop() {
	p.mu.Lock()
	p.stopped = true
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

// waitJetStream waits until url answers JetStream requests.
func waitJetStream(url string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := func() error {
			nc, err := nats.Connect(url, nats.Timeout(time.Second))
			if err != nil {
				return err
			}
			defer nc.Close()
			js, err := jetstream.New(nc)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			_, err = js.AccountInfo(ctx)
			return err
		}()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nats-server at %s never became ready: %w", url, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// openBroker opens a Broker on url with test-friendly settings changed by
// mutate; it closes with the test, and on the shared server the streams it
// touched are deleted when the top-level test ends.
func openBroker(t testing.TB, url string, mutate func(*Config)) *Broker {
	t.Helper()
	cfg := Config{URL: url}
	if mutate != nil {
		mutate(&cfg)
	}
	b, err := Open(context.Background(), cfg, adapters.Options{ConnectTimeout: 10 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() {
		registerStreams(b)
		require.NoError(t, b.Close())
	})
	return b
}

// Streams made on the shared server are deleted at the end of the test run
// (TestMain), not by each test: several tests' brokers share a topic.
var created = struct {
	sync.Mutex
	streams map[string]map[string]bool // URL -> stream names
}{streams: map[string]map[string]bool{}}

func registerStreams(b *Broker) {
	if b.embedded != nil {
		return
	}
	b.mu.Lock()
	var names []string
	for topic := range b.streams {
		names = append(names, StreamName(topic))
	}
	b.mu.Unlock()
	created.Lock()
	defer created.Unlock()
	if created.streams[b.url] == nil {
		created.streams[b.url] = map[string]bool{}
	}
	for _, n := range names {
		created.streams[b.url][n] = true
	}
}

// trackStream records a stream a test made without a Broker.
func trackStream(url, stream string) {
	created.Lock()
	defer created.Unlock()
	if created.streams[url] == nil {
		created.streams[url] = map[string]bool{}
	}
	created.streams[url][stream] = true
}

// deleteCreatedStreams deletes the streams the tests made on servers that
// are still up.
func deleteCreatedStreams() {
	created.Lock()
	defer created.Unlock()
	for url, streams := range created.streams {
		nc, err := nats.Connect(url, nats.Timeout(2*time.Second))
		if err != nil {
			continue // a private server that is gone already
		}
		js, err := jetstream.New(nc)
		if err == nil {
			for s := range streams {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				err := js.DeleteStream(ctx, s)
				cancel()
				if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
					fmt.Fprintf(os.Stderr, "cleanup: deleting stream %s on %s: %v\n", s, url, err)
				}
			}
		}
		nc.Close()
	}
}
