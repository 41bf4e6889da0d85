package nats

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/internal/adapterkit"
	"github.com/millrace-io/millrace/adapters/nats/internal/embed"
	"github.com/millrace-io/millrace/internal/confload"
)

// Broker is a connection to NATS JetStream as millrace uses it: a
// publishing connection shared by Publisher and PublishBatch, one connection
// per Subscribe call, and, with broker.nats.embedded, the in-process server they
// connect to. It is safe for concurrent use.
type Broker struct {
	cfg    Config
	rules  adapters.Rules
	opts   adapters.Options
	url    string // the URL clients connect to (the embedded server's actual one)
	logger watermill.LoggerAdapter

	embedded embed.Server
	nc       *nats.Conn          // publishing and management connection
	js       jetstream.JetStream // management and PublishBatch
	wmPub    *wmnats.Publisher   // Publisher's path: watermill-nats over nc

	pending sync.Map      // *nats.Msg in flight in PublishBatch -> *batchState
	window  chan struct{} // one token per in-flight message of PublishBatch

	mu          sync.Mutex
	streams     map[string]bool // topics whose stream is known to match the config
	consumers   map[string]bool // topic + "\x00" + group whose consumer is known to match
	ordered     map[string]bool // topic + "\x00" + group provisioned as ordered (ProvisionGroup)
	subscribers []io.Closer     // every subscriber, to close with the Broker
	closed      bool
}

// Open connects with the reliable defaults of this adapter and returns a
// *Broker that implements adapters.Broker. cfg gets its defaults applied and
// is validated first. With cfg.Embedded.Enabled it first starts an in-process
// nats-server listening on cfg.URL, which needs package natsdev imported. An unreachable server is an error within
// opts.ConnectTimeout naming the URL (never its password); so is a server
// without JetStream.
func Open(ctx context.Context, cfg Config, opts adapters.Options) (*Broker, error) {
	return adapterkit.Open(ctx, Kind, cfg, opts, open)
}

// Connect is Open for a Config that has its defaults and that Validate
// accepted (adapters.Section).
func (c Config) Connect(ctx context.Context, opts adapters.Options) (adapters.Broker, error) {
	return adapterkit.Connect(ctx, c, opts, open)
}

func open(ctx context.Context, cfg Config, opts adapters.Options) (*Broker, error) {
	cfg.TLS.WarnInsecure(opts.Logger, "broker.nats.tls")
	var srv embed.Server
	url := cfg.URL
	if cfg.Embedded.Enabled {
		var err error
		if srv, err = embed.Start(cfg.URL, embed.Options{StoreDir: cfg.Embedded.StoreDir, Sync: cfg.Embedded.Sync, Logger: opts.Logger}); err != nil {
			return nil, err
		}
		url = srv.URL()
	}
	b := &Broker{
		cfg:       cfg,
		rules:     cfg.Rules(),
		opts:      opts,
		url:       url,
		logger:    opts.Logger,
		embedded:  srv,
		streams:   map[string]bool{},
		consumers: map[string]bool{},
		ordered:   map[string]bool{},
		window:    make(chan struct{}, cfg.Publish.MaxPending),
	}
	ok := false
	defer func() {
		if !ok {
			_ = b.Close()
		}
	}()

	nc, err := b.connect(ctx, "millrace-publisher")
	if err != nil {
		return nil, err
	}
	b.nc = nc
	b.js, err = jetstream.New(nc,
		jetstream.WithPublishAsyncTimeout(cfg.Publish.Timeout),
		jetstream.WithPublishAsyncAckHandler(b.onAsyncAck),
		jetstream.WithPublishAsyncErrHandler(b.onAsyncError),
		jetstream.WithDefaultTimeout(opts.ConnectTimeout),
	)
	if err != nil {
		return nil, fmt.Errorf("nats: %w", err)
	}
	actx, cancel := context.WithTimeout(ctx, opts.ConnectTimeout)
	defer cancel()
	if _, err := b.js.AccountInfo(actx); err != nil {
		if errors.Is(err, jetstream.ErrJetStreamNotEnabled) || errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) {
			return nil, fmt.Errorf("nats: JetStream is not enabled on %s (start nats-server with -js): %w", redact(b.url), err)
		}
		return nil, fmt.Errorf("nats: JetStream on %s did not answer within %s: %w", redact(b.url), opts.ConnectTimeout, err)
	}
	b.wmPub, err = wmnats.NewPublisherWithNatsConn(nc, wmnats.PublisherPublishConfig{
		Marshaler:         marshaler{},
		SubjectCalculator: wmnats.DefaultSubjectCalculator,
		JetStream: wmnats.JetStreamConfig{
			// Nats-Msg-Id = msg.UUID, so the server's duplicate window drops a re-publish.
			TrackMsgId:     true,
			ConnectOptions: []nats.JSOpt{nats.MaxWait(cfg.Publish.Timeout)},
		},
	}, opts.Logger)
	if err != nil {
		return nil, fmt.Errorf("nats: %w", err)
	}
	b.logger.Info("Connected to NATS JetStream", watermill.LogFields{
		"url": redact(b.url), "server_version": nc.ConnectedServerVersion(), "embedded": b.embedded != nil,
	})
	ok = true
	return b, nil
}

// URL is the URL the broker's connections use: broker.nats.url, or the
// embedded server's URL with its actual port.
func (b *Broker) URL() string { return b.url }

// Config is the configuration in effect, defaults applied.
func (b *Broker) Config() Config { return b.cfg }

// connect opens one connection with millrace's settings: bounded connect,
// endless reconnects, a dead server left after two unanswered pings or a
// write blocked for as long, and no reconnect buffer, so a publish while the
// server is away fails at once (retryable) instead of waiting in a client
// buffer.
func (b *Broker) connect(ctx context.Context, name string, extra ...nats.Option) (*nats.Conn, error) {
	logFields := watermill.LogFields{"connection": name, "url": redact(b.url)}
	options := append([]nats.Option{
		nats.Name(name),
		nats.Timeout(b.opts.ConnectTimeout),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.PingInterval(b.cfg.PingInterval),
		nats.MaxPingsOutstanding(2),
		// A write to a server cut off the network blocks once the socket's
		// buffer is full, holding the connection's lock, so pings cannot
		// mark it dead: bound the write as the pings bound a silent server
		// (nats.go: one minute, and no reconnect after it).
		nats.FlusherTimeout(2 * b.cfg.PingInterval),
		nats.ReconnectOnFlusherError(),
		nats.ReconnectJitter(250*time.Millisecond, time.Second),
		nats.ReconnectBufSize(-1),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				b.logger.Info("NATS disconnected", logFields.Add(watermill.LogFields{"err": b.scrub(err)}))
			} else {
				b.logger.Info("NATS disconnected", logFields)
			}
		}),
		nats.ReconnectHandler(func(*nats.Conn) { b.logger.Info("NATS reconnected", logFields) }),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subject := ""
			if sub != nil {
				subject = sub.Subject
			}
			b.logger.Error("NATS async error", errors.New(b.scrub(err)), logFields.Add(watermill.LogFields{"subject": subject}))
		}),
	}, extra...)
	security, err := b.securityOptions()
	if err != nil {
		return nil, err
	}
	options = append(options, security...)

	done := make(chan connResult, 1)
	go func() {
		nc, err := nats.Connect(b.url, options...)
		done <- connResult{nc, err}
	}()
	timer := time.NewTimer(b.opts.ConnectTimeout)
	defer timer.Stop()
	select {
	case r := <-done:
		if r.err != nil {
			return nil, b.connectError(r.err)
		}
		return r.nc, nil
	case <-timer.C:
		go closeLate(done)
		return nil, b.connectError(nats.ErrTimeout)
	case <-ctx.Done():
		go closeLate(done)
		return nil, fmt.Errorf("nats: cannot connect to %s: %w", redact(b.url), ctx.Err())
	}
}

// connectError says why connecting failed, naming the URL without its
// password: "within" the connect timeout only when it elapsed, refused
// when no server accepted the connection (nats.go reports that as
// ErrNoServers), else the client's own reason.
func (b *Broker) connectError(err error) error {
	var netErr net.Error
	switch {
	case errors.Is(err, nats.ErrTimeout), errors.As(err, &netErr) && netErr.Timeout():
		return adapterkit.Unreachable(Kind, redact(b.url), fmt.Errorf("no answer within %s (broker.connect_timeout)", b.opts.ConnectTimeout))
	case errors.Is(err, nats.ErrNoServers):
		return adapterkit.Unreachable(Kind, redact(b.url), errors.New("connection refused (is nats-server running and listening there?)"))
	}
	return adapterkit.Unreachable(Kind, redact(b.url), errors.New(b.scrub(err)))
}

type connResult struct {
	nc  *nats.Conn
	err error
}

// closeLate closes a connection that was established after its caller gave up.
func closeLate(done <-chan connResult) {
	if r := <-done; r.nc != nil {
		r.nc.Close()
	}
}

// Publisher returns a Watermill publisher (watermill-nats) that sends each
// message with Nats-Msg-Id set to msg.UUID and waits for JetStream's
// confirm. It creates a topic's stream on first use. Closing it does not
// close the broker's connection; Broker.Close does.
func (b *Broker) Publisher() message.Publisher { return &publisher{b: b} }

// Close closes every subscriber this broker made, its connection and, if it
// started one, the embedded server. It is idempotent.
func (b *Broker) Close() error {
	var subs []io.Closer
	if !adapterkit.MarkClosed(&b.mu, &b.closed, func() { subs, b.subscribers = b.subscribers, nil }) {
		return nil
	}

	errs := []error{adapterkit.CloseAll(slices.Values(subs))}
	if b.nc != nil {
		// Drain fails only when the connection is down or closed already;
		// then there is nothing to flush and Close suffices.
		if err := b.nc.Drain(); err == nil {
			waitClosed(b.nc, b.cfg.Publish.Timeout)
		}
		b.nc.Close()
	}
	if b.embedded != nil {
		b.embedded.Shutdown()
	}
	return errors.Join(errs...)
}

// waitClosed waits until a draining connection has closed, at most d.
func waitClosed(nc *nats.Conn, d time.Duration) {
	deadline := time.Now().Add(d)
	for !nc.IsClosed() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	nc.Close()
}

func (b *Broker) isClosed() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.closed
}

// publisher is Broker.Publisher's message.Publisher.
type publisher struct {
	b      *Broker
	mu     sync.RWMutex
	closed bool
}

// errPublisherClosed is returned by Publish after Close.
var errPublisherClosed = errors.New("nats: publisher closed")

func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed || p.b.isClosed() {
		return errPublisherClosed
	}
	if err := checkTopic(topic); err != nil {
		return adapters.Permanent(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.b.cfg.Publish.Timeout)
	defer cancel()
	if err := p.b.ensureStream(ctx, topic); err != nil {
		return err
	}
	for _, m := range msgs {
		if err := p.b.wmPub.Publish(topic, m); err != nil {
			return p.b.classify(topic, m, nil, err)
		}
	}
	return nil
}

func (p *publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	return nil
}

// securityOptions are the nats.go options for broker.nats.tls and the
// configured credentials.
func (b *Broker) securityOptions() ([]nats.Option, error) {
	var opts []nats.Option
	if b.cfg.tlsOn() {
		tc, err := b.cfg.TLS.ClientConfig("broker.nats.tls")
		if err != nil {
			return nil, err
		}
		opts = append(opts, nats.Secure(tc))
	}
	switch {
	case b.cfg.User != "":
		opts = append(opts, nats.UserInfo(b.cfg.User, b.cfg.Password))
	case b.cfg.Token != "":
		opts = append(opts, nats.Token(b.cfg.Token))
	case b.cfg.NKeySeedFile != "":
		o, err := nats.NkeyOptionFromSeed(b.cfg.NKeySeedFile)
		if err != nil {
			return nil, fmt.Errorf("nats: broker.nats.nkey_seed_file %s: %s", b.cfg.NKeySeedFile, fileProblem(err))
		}
		opts = append(opts, o)
	case b.cfg.CredsFile != "":
		opts = append(opts, nats.UserCredentials(b.cfg.CredsFile))
	}
	return opts, nil
}

// redact returns rawURL without its password, or its token (a NATS URL
// with a user and no password, nats://token@host, carries a token).
func redact(rawURL string) string {
	urls := strings.Split(rawURL, ",")
	for i, u := range urls {
		urls[i] = confload.RedactURL(strings.TrimSpace(u))
	}
	return strings.Join(urls, ",")
}

// scrub returns err's text without any secret of the configuration: the
// URL's password or token, broker.nats.password and broker.nats.token.
func (b *Broker) scrub(err error) string {
	text := err.Error()
	secrets := []string{b.cfg.Password, b.cfg.Token}
	for _, raw := range strings.Split(b.url, ",") {
		if u, perr := url.Parse(strings.TrimSpace(raw)); perr == nil && u.User != nil {
			if pw, ok := u.User.Password(); ok {
				secrets = append(secrets, pw)
			} else {
				secrets = append(secrets, u.User.Username())
			}
		}
	}
	for _, s := range secrets {
		if s != "" {
			text = strings.ReplaceAll(text, s, "xxxxx")
		}
	}
	return text
}
