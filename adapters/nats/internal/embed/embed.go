package embed

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/adapters/internal/adapterkit"
)

// SyncAlways is the Sync value that fsyncs every write.
const SyncAlways = "always"

// Options configure an in-process server.
type Options struct {
	// StoreDir is where the server keeps its streams.
	StoreDir string
	// Sync is SyncAlways or a flush interval such as "2m".
	Sync string
	// Logger receives the server's log; nil discards it.
	Logger watermill.LoggerAdapter
}

// ErrNotLinked is returned by Start when no package registered a starter.
var ErrNotLinked = errors.New("the embedded nats-server is not linked into this program")

// Server is a running in-process server.
type Server interface {
	// URL is the nats:// URL clients connect to, with the actual port.
	URL() string
	// Shutdown stops the server and waits until it has stopped.
	Shutdown()
}

// StartFunc starts an in-process server listening on the host and port of
// listenURL.
type StartFunc func(listenURL string, o Options) (Server, error)

// Starter is the StartFunc that package natsdev registers.
var Starter adapterkit.Link[StartFunc]

// Start starts an in-process server with the registered starter, or returns
// ErrNotLinked.
func Start(listenURL string, o Options) (Server, error) {
	start, ok := Starter.Func()
	if !ok {
		return nil, ErrNotLinked
	}
	return start(listenURL, o)
}

// DefaultStoreDir is the store directory used when none is set.
func DefaultStoreDir() string { return filepath.Join(os.TempDir(), "millrace-nats") }

// ParseSync turns a Sync value into the server's sync-always flag (interval
// 0) or flush interval.
func ParseSync(s string) (interval time.Duration, err error) {
	if s == SyncAlways {
		return 0, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf(`must be "always" or a positive duration such as "2m"; got %q`, s)
	}
	return d, nil
}

// ListenAddr returns the host and port a server listens on for rawURL. No
// port means NATS's 4222; port 0 asks for a free port.
func ListenAddr(rawURL string) (host string, port int, err error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", 0, fmt.Errorf("not a valid URL")
	}
	host = u.Hostname()
	if host == "" {
		return "", 0, fmt.Errorf("no host in %s", u.Redacted())
	}
	port = 4222
	if p := u.Port(); p != "" {
		port, err = strconv.Atoi(p)
		if err != nil || port < 0 || port > 65535 {
			return "", 0, fmt.Errorf("invalid port %q", p)
		}
	}
	return host, port, nil
}
