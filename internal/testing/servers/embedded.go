package servers

import (
	"fmt"
	"sync"
	"testing"

	"github.com/millrace-io/millrace/adapters/nats/natsdev"
)

// EmbeddedNATS is an in-process nats-server with JetStream (package
// natsdev) on its own port with its own store directory, that a test may
// restart in place: the same port, the same streams.
type EmbeddedNATS struct {
	// URL is the server's client URL, the same across restarts.
	URL string

	t    testing.TB
	dir  string
	port int

	mu  sync.Mutex
	srv *natsdev.Server
}

// StartEmbeddedNATS starts an in-process server on a free port of 127.0.0.1
// with a store directory of its own (fsync on every write) and returns once
// it accepts connections. It stops when t ends.
func StartEmbeddedNATS(t testing.TB) *EmbeddedNATS {
	t.Helper()
	e := &EmbeddedNATS{t: t, dir: t.TempDir()}
	srv, err := natsdev.Start("nats://127.0.0.1:0", natsdev.Options{StoreDir: e.dir})
	if err != nil {
		t.Fatalf("start an embedded NATS server: %v", err)
	}
	e.srv, e.port, e.URL = srv, srv.Port(), srv.URL()
	t.Cleanup(func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.srv.Shutdown()
	})
	return e
}

// Restart shuts the server down and starts it again on the same port and
// store directory.
func (e *EmbeddedNATS) Restart() {
	e.t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.srv.Shutdown()
	srv, err := natsdev.Start(fmt.Sprintf("nats://127.0.0.1:%d", e.port), natsdev.Options{StoreDir: e.dir})
	if err != nil {
		e.t.Fatalf("restart the embedded NATS server on port %d: %v", e.port, err)
	}
	e.srv = srv
}
