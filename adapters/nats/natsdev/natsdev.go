package natsdev

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/millrace-io/millrace/adapters/nats/internal/embed"
)

func init() {
	embed.Starter.Register(func(listenURL string, o embed.Options) (embed.Server, error) {
		return Start(listenURL, Options(o))
	})
}

// Options configure Start.
type Options struct {
	// StoreDir is where the server keeps its streams. Defaults to
	// millrace-nats in the system's temporary directory.
	StoreDir string
	// Sync is when the server flushes stream files to disk: "always" (fsync
	// before confirming each message) or a duration such as "2m" (flush every
	// interval). Defaults to "always".
	Sync string
	// Logger receives the server's log. Defaults to none.
	Logger watermill.LoggerAdapter
}

// Server is a nats-server with JetStream and file storage running inside
// this process: what tests and the demo use when no NATS server is
// installed. Messages survive a Shutdown and a new Start on the same store
// directory.
type Server struct {
	srv *server.Server
	url string

	once sync.Once
}

// Start starts an in-process nats-server with JetStream, listening on the
// host and port of listenURL (port 0 picks a free port; user and password in
// the URL become the server's only credentials) and storing streams in
// o.StoreDir with o.Sync. It returns once the server accepts connections.
func Start(listenURL string, o Options) (*Server, error) {
	if o.StoreDir == "" {
		o.StoreDir = embed.DefaultStoreDir()
	}
	if o.Sync == "" {
		o.Sync = embed.SyncAlways
	}
	interval, err := embed.ParseSync(o.Sync)
	if err != nil {
		return nil, fmt.Errorf("nats: embedded server: sync: %w", err)
	}
	host, port, err := embed.ListenAddr(listenURL)
	if err != nil {
		return nil, fmt.Errorf("nats: embedded server: %w", err)
	}
	if port == 0 {
		port = server.RANDOM_PORT // the server's 0 means its default port, 4222
	} else {
		// The server reports a busy port only by not becoming ready; try it first.
		l, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
		if err != nil {
			return nil, fmt.Errorf("nats: embedded server cannot listen on %s:%d (another nats-server there? then set embedded.enabled: false to use it): %w", host, port, err)
		}
		_ = l.Close()
	}
	if err := os.MkdirAll(o.StoreDir, 0o750); err != nil {
		return nil, fmt.Errorf("nats: embedded server: store_dir: %w", err)
	}
	opts := &server.Options{
		ServerName: "millrace-embedded",
		Host:       host,
		Port:       port,
		JetStream:  true,
		StoreDir:   o.StoreDir,
		NoSigs:     true,
		NoLog:      o.Logger == nil,
	}
	if interval == 0 {
		opts.SyncAlways = true
	} else {
		opts.SyncInterval = interval
	}
	if u, _ := url.Parse(listenURL); u != nil && u.User != nil {
		opts.Username = u.User.Username()
		opts.Password, _ = u.User.Password()
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("nats: embedded server on %s:%d: %w", host, port, err)
	}
	if o.Logger != nil {
		srv.SetLoggerV2(serverLogger{o.Logger}, false, false, false)
	}
	srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		srv.WaitForShutdown()
		return nil, fmt.Errorf("nats: embedded server did not start on %s:%d (is the port in use? store_dir %s)",
			host, port, o.StoreDir)
	}
	addr := srv.Addr().String()
	client := &url.URL{Scheme: "nats", Host: addr}
	if opts.Username != "" {
		client.User = url.UserPassword(opts.Username, opts.Password)
	}
	return &Server{srv: srv, url: client.String()}, nil
}

// URL is the nats:// URL clients connect to, with the actual port.
func (s *Server) URL() string { return s.url }

// Addr is the host:port the server listens on.
func (s *Server) Addr() string { return s.srv.Addr().String() }

// Port is the port the server listens on.
func (s *Server) Port() int {
	u, _ := url.Parse(s.url)
	p, _ := strconv.Atoi(u.Port())
	return p
}

// Shutdown stops the server and waits until it has stopped. It is idempotent.
func (s *Server) Shutdown() {
	s.once.Do(func() {
		s.srv.Shutdown()
		s.srv.WaitForShutdown()
	})
}

// serverLogger sends the embedded server's log to Watermill's logger.
type serverLogger struct{ l watermill.LoggerAdapter }

func (s serverLogger) fields() watermill.LogFields {
	return watermill.LogFields{"component": "nats-server"}
}

func (s serverLogger) Noticef(format string, v ...any) {
	s.l.Info(fmt.Sprintf(format, v...), s.fields())
}
func (s serverLogger) Warnf(format string, v ...any) { s.l.Info(fmt.Sprintf(format, v...), s.fields()) }
func (s serverLogger) Fatalf(format string, v ...any) {
	s.l.Error("fatal", fmt.Errorf(format, v...), s.fields())
}
func (s serverLogger) Errorf(format string, v ...any) {
	s.l.Error("error", fmt.Errorf(format, v...), s.fields())
}
func (s serverLogger) Debugf(format string, v ...any) {
	s.l.Debug(fmt.Sprintf(format, v...), s.fields())
}
func (s serverLogger) Tracef(format string, v ...any) {
	s.l.Trace(fmt.Sprintf(format, v...), s.fields())
}
