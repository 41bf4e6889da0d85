package rabbit

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"maps"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/internal/adapterkit"
	"github.com/millrace-io/millrace/internal/confload"
)

// errClosed is returned by every call on a closed Broker.
var errClosed = fmt.Errorf("rabbitmq: %w", adapters.ErrClosed)

// Broker is a RabbitMQ connection as millrace uses it: quorum queues, one
// per topic and consumer group, with publisher confirms on every publish.
// It is safe for concurrent use.
type Broker struct {
	cfg      Config
	rules    adapters.Rules
	opts     adapters.Options
	redacted string       // cfg.URL without its password, for errors and logs
	lastNode atomic.Int32 // index in cfg.urls() of the node that answered last
	tls      *tls.Config  // broker.rabbitmq.tls for an amqps:// URL; nil leaves TLS to the URL
	declarer declarer

	mu       sync.Mutex
	closed   bool
	conn     *amqp.Connection // the publishing connection; redialled when lost
	blocked  string           // why the broker blocks conn's publishers, "" when it does not
	idle     []*confirmChannel
	declared map[string]bool // topics whose publishing topology exists
	// serverMax is the server's max_message_size once a refusal told it, 0 before.
	serverMax int
	subs      map[*subscriber]struct{}
	watchers  sync.WaitGroup // goroutines watching conn
}

// Open connects with the reliable defaults of this adapter and returns a
// *Broker that implements adapters.Broker. cfg gets WithDefaults applied and
// is validated. An unreachable broker is an error naming the URL (without
// its password) within opts.ConnectTimeout, or sooner when ctx ends.
func Open(ctx context.Context, cfg Config, opts adapters.Options) (*Broker, error) {
	return adapterkit.Open(ctx, Kind, cfg, opts, open)
}

// Connect is Open for a Config that has its defaults and that Validate
// accepted (adapters.Section).
func (c Config) Connect(ctx context.Context, opts adapters.Options) (adapters.Broker, error) {
	return adapterkit.Connect(ctx, c, opts, open)
}

func open(ctx context.Context, cfg Config, opts adapters.Options) (*Broker, error) {
	var tc *tls.Config
	if cfg.tlsOn() && len(cfg.urlTLS()) == 0 {
		var err error
		if tc, err = cfg.TLS.ClientConfig("broker.rabbitmq.tls"); err != nil {
			return nil, fmt.Errorf("rabbitmq: %w", err)
		}
	}
	cfg.TLS.WarnInsecure(opts.Logger, "broker.rabbitmq.tls")
	b := &Broker{
		cfg:      cfg,
		rules:    cfg.Rules(),
		opts:     opts,
		redacted: redactList(cfg.urls()),
		tls:      tc,
		declarer: declarer{deliveryLimit: cfg.DeliveryLimit},
		declared: map[string]bool{},
		subs:     map[*subscriber]struct{}{},
	}
	if _, err := b.connection(ctx); err != nil {
		return nil, err
	}
	return b, nil
}

// amqpConfig is the client configuration of every connection: dialling and
// the AMQP handshake bounded by ConnectTimeout (and ctx), heartbeats from
// config, and a connection name that shows up in the management UI.
func (b *Broker) amqpConfig(ctx context.Context, role string) amqp.Config {
	timeout := b.opts.ConnectTimeout
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName("millrace " + role)
	var auth []amqp.Authentication // nil: the URL's credentials
	if b.cfg.User != "" {
		auth = []amqp.Authentication{&amqp.PlainAuth{Username: b.cfg.User, Password: b.cfg.Password}}
	}
	var tc *tls.Config
	if b.tls != nil {
		tc = b.tls.Clone() // amqp091 sets ServerName on it
	}
	return amqp.Config{
		Heartbeat:       b.cfg.Heartbeat,
		Locale:          "en_US",
		Properties:      props,
		SASL:            auth,
		TLSClientConfig: tc,
		Dial: func(network, addr string) (net.Conn, error) {
			dctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			var d net.Dialer
			conn, err := d.DialContext(dctx, network, addr)
			if err != nil {
				return nil, err
			}
			// The deadline bounds the TLS and AMQP handshakes; amqp091
			// clears it once the connection is open.
			deadline, _ := dctx.Deadline()
			if err := conn.SetDeadline(deadline); err != nil {
				conn.Close()
				return nil, err
			}
			return conn, nil
		},
	}
}

// connection returns the publishing connection, dialling it when there is
// none or it was lost (a broker restart): publishing reconnects on demand,
// and a failed dial is a retryable error.
func (b *Broker) connection(ctx context.Context) (*amqp.Connection, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return liveConn(b.closed, errClosed, &b.conn, func() (*amqp.Connection, error) {
		if err := ctx.Err(); err != nil {
			return nil, adapterkit.Unreachable(Kind, b.redacted, err)
		}
		conn, err := b.dial(ctx, "publisher")
		if err != nil {
			return nil, adapterkit.Unreachable(Kind, b.redacted, err)
		}
		b.blocked, b.idle = "", nil
		clear(b.declared)
		blocks := conn.NotifyBlocked(make(chan amqp.Blocking, 1))
		b.watchers.Add(1)
		go b.watchBlocked(conn, blocks)
		return conn, nil
	})
}

// liveConn returns *conn while it is open. Otherwise, unless closed (then
// errClosed), it keeps the connection dial makes in *conn and returns it.
// The caller holds the lock that guards closed and *conn.
func liveConn(closed bool, errClosed error, conn **amqp.Connection, dial func() (*amqp.Connection, error)) (*amqp.Connection, error) {
	if closed {
		return nil, errClosed
	}
	if *conn != nil && !(*conn).IsClosed() {
		return *conn, nil
	}
	c, err := dial()
	if err != nil {
		return nil, err
	}
	*conn = c
	return c, nil
}

// dial connects to the first node of broker.rabbitmq.url that answers,
// starting with the one that answered last: with a cluster's list, a node
// that went down sends new connections to the next.
func (b *Broker) dial(ctx context.Context, role string) (*amqp.Connection, error) {
	urls := b.cfg.urls()
	start := int(b.lastNode.Load())
	var errs []error
	for i := range urls {
		n := (start + i) % len(urls)
		conn, err := amqp.DialConfig(urls[n], b.amqpConfig(ctx, role))
		if err == nil {
			b.lastNode.Store(int32(n))
			return conn, nil
		}
		if len(urls) > 1 {
			err = fmt.Errorf("%s: %w", confload.RedactURL(urls[n]), err)
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, errors.Join(errs...)
}

// redactList is the URLs without their passwords, comma separated.
func redactList(urls []string) string {
	out := make([]string, len(urls))
	for i, u := range urls {
		out[i] = confload.RedactURL(u)
	}
	return strings.Join(out, ",")
}

// watchBlocked records connection.blocked / unblocked notifications (a
// memory or disk alarm on the broker) until conn closes; a closed
// connection blocks nothing.
func (b *Broker) watchBlocked(conn *amqp.Connection, blocks <-chan amqp.Blocking) {
	defer b.watchers.Done()
	for bl := range blocks {
		b.mu.Lock()
		if b.conn == conn {
			b.blocked = ""
			if bl.Active {
				b.blocked = bl.Reason
			}
		}
		b.mu.Unlock()
		b.opts.Logger.Info("RabbitMQ publishing blocked state changed", map[string]any{"blocked": bl.Active, "reason": bl.Reason})
	}
	b.mu.Lock()
	if b.conn == conn {
		b.blocked = ""
	}
	b.mu.Unlock()
}

// dropOnCancel makes conn drop if ctx ends before the returned func is
// called. AMQP calls (declarations, channel open and close, a publish
// write) do not take a context and wait as long as the broker does not
// answer: a broker under a resource alarm stops reading from a connection
// that published. Dropping the connection ends them; the next call
// reconnects, and a message left unconfirmed is reported as such.
func (b *Broker) dropOnCancel(ctx context.Context, conn *amqp.Connection) (stop func() bool) {
	return context.AfterFunc(ctx, func() {
		b.opts.Logger.Info("Dropping the RabbitMQ publishing connection: a call outlived its context", nil)
		_ = conn.CloseDeadline(time.Now())
	})
}

// Provision declares the topology of topic and of each consumer group:
// exchanges, the group's quorum queue, its dead-letter queue and the parking
// queue for unroutable messages. It is idempotent. An existing object with
// other settings is an error wrapping adapters.ErrTopologyConflict.
func (b *Broker) Provision(ctx context.Context, topic string, consumerGroups ...string) error {
	conn, stop, err := b.topologyConnection(ctx, topic, consumerGroups)
	if err != nil {
		return err
	}
	defer stop()
	tc := &topoChannel{conn: conn}
	defer tc.close()
	if err := b.declarer.declareTopic(tc, topic); err != nil {
		return err
	}
	for _, g := range consumerGroups {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := b.declarer.declareGroup(tc, topic, g); err != nil {
			return err
		}
	}
	b.mu.Lock()
	if b.conn == conn {
		b.declared[topic] = true
	}
	b.mu.Unlock()
	return nil
}

// ProvisionGroup is Provision for one group, which gets what is published
// to topic after its queue is bound. A queue holds only what was routed to
// it, so a new group cannot start at the topic's history: adapters.StartAll
// is a permanent error, and bus refuses consumer.start: all for RabbitMQ
// in its config. A RabbitMQ queue returns an unacked message to its head,
// so group.Ordered needs no settings of its own. See adapters.Broker.
func (b *Broker) ProvisionGroup(ctx context.Context, topic string, group adapters.GroupSpec) error {
	if group.Start == adapters.StartAll {
		return adapters.Permanent(fmt.Errorf("rabbitmq: consumer group %q of topic %q cannot start at the topic's history (start all): %s",
			group.Name, topic, ErrNoHistory))
	}
	return b.Provision(ctx, topic, group.Name)
}

// ErrNoHistory says why a RabbitMQ consumer group cannot start at its
// topic's history.
var ErrNoHistory = errors.New("a RabbitMQ queue gets only what is published after it is bound to the topic's exchange; " +
	"the quorum queues millrace uses keep no history for a new queue to replay (that would take a RabbitMQ stream)")

// Publisher returns a message.Publisher over PublishBatch: each Publish call
// is one pipelined batch that returns once the broker confirmed every
// message. Its Close does not close the Broker. It publishes consumed
// messages again (the poison topic), so it leaves out the headers RabbitMQ
// set on their delivery (x-delivery-count, x-death, ...): they describe that
// delivery, not the event. PublishBatch refuses them.
func (b *Broker) Publisher() message.Publisher { return &publisher{b: b} }

type publisher struct {
	b      *Broker
	mu     sync.Mutex
	closed bool
}

// Publish publishes msgs to topic and waits for the broker's confirms. The
// context of the first message bounds the call.
func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return errors.New("rabbitmq: publisher is closed")
	}
	if len(msgs) == 0 {
		return nil
	}
	out := make([]adapters.Outgoing, len(msgs))
	for i, m := range msgs {
		out[i] = adapters.Outgoing{Topic: topic, Msg: withoutDeliveryHeaders(m)}
	}
	err := p.b.PublishBatch(msgs[0].Context(), out)
	var be *adapters.BatchError
	if errors.As(err, &be) {
		i := be.FirstUnconfirmed()
		return fmt.Errorf("rabbitmq: publish to %q: %d of %d messages not confirmed, first %s: %w",
			topic, be.Failed(), len(msgs), msgs[i].UUID, be.Errs[i])
	}
	return err
}

// Close stops this publisher; the Broker and its connection stay open.
func (p *publisher) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	return nil
}

// Close closes every subscriber this Broker made and its connection. It is
// idempotent.
func (b *Broker) Close() error {
	var conn *amqp.Connection
	var subs map[*subscriber]struct{}
	if !adapterkit.MarkClosed(&b.mu, &b.closed, func() {
		conn = b.conn
		b.idle = nil // closing conn closes them
		subs = maps.Clone(b.subs)
	}) {
		return nil
	}

	errs := []error{adapterkit.CloseAll(maps.Keys(subs))}
	if conn != nil && !conn.IsClosed() {
		// Bounded: a blocked or unresponsive broker may never answer.
		if err := conn.CloseDeadline(time.Now().Add(b.opts.ConnectTimeout)); err != nil && !errors.Is(err, amqp.ErrClosed) {
			errs = append(errs, fmt.Errorf("rabbitmq: close connection to %s: %w", b.redacted, err))
		}
	}
	b.watchers.Wait()
	return errors.Join(errs...)
}

// withoutDeliveryHeaders returns msg, or a copy of it without the headers
// RabbitMQ sets on a delivery (brokerHeader).
func withoutDeliveryHeaders(msg *message.Message) *message.Message {
	var out *message.Message
	for k := range msg.Metadata {
		if !brokerHeader(k) {
			continue
		}
		if out == nil {
			out = msg.Copy()
			out.SetContext(msg.Context())
		}
		delete(out.Metadata, k)
	}
	if out == nil {
		return msg
	}
	return out
}
