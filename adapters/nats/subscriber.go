package nats

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/internal/adapterkit"
)

// subscriberCloseTimeout bounds how long closing waits for in-flight messages
// to be handed back; they are never acked by closing.
const subscriberCloseTimeout = 30 * time.Second

// subscriber is the message.Subscriber of one consumer group. Each Subscribe
// call is a watermill-nats JetStream subscriber of its own (own connection),
// bound to the group's durable consumer on the topic's stream.
type subscriber struct {
	b     *Broker
	group string

	mu     sync.Mutex
	subs   []*subscription
	closed bool
}

var (
	_ message.Subscriber           = (*subscriber)(nil)
	_ message.SubscribeInitializer = (*subscriber)(nil)
)

// errSubscriberClosed is returned by Subscribe after Close.
var errSubscriberClosed = errors.New("nats: subscriber closed")

// Subscriber returns a subscriber for spec.Group. Every group gets every
// message of a topic; the subscriptions of one group (consumer.subscribers
// per Subscribe call, in this or any other process) compete. A message is
// acked only by msg.Ack (the server confirms the ack); Nack makes the server
// deliver it again after consumer.nak_delay; a message neither acked nor
// nacked (handler too slow, subscriber closed, process gone) is delivered
// again after consumer.ack_wait. Subscribe creates the topic's stream and the
// group's consumer when they are missing.
//
// An Ordered spec gets an ordered subscription (subscribeOrdered), one with
// InFlight or a RedeliveryWait a concurrent one (subscribeConcurrent); a
// spec the Broker cannot serve (adapters.CheckSpec) is an
// *adapters.SpecError.
func (b *Broker) Subscriber(spec adapters.SubscriberSpec) (message.Subscriber, error) {
	if err := checkGroup(spec.Group); err != nil {
		return nil, fmt.Errorf("nats: %w", err)
	}
	if err := adapters.CheckSpec(Kind, b.Capabilities(), spec, 0); err != nil {
		return nil, err
	}
	switch {
	case spec.Ordered:
		return b.subscribeOrdered(spec)
	case spec.InFlight > 0 || spec.RedeliveryWait != nil:
		return b.subscribeConcurrent(spec)
	}
	s := &subscriber{b: b, group: spec.Group}
	if err := b.register(s); err != nil {
		return nil, err
	}
	return s, nil
}

// lifecycle is what the ordered and concurrent subscribers share: each
// Subscribe call runs in goroutines of its own (counted in running) until
// its context ends or the subscriber closes.
type lifecycle struct {
	b         *Broker
	mu        sync.Mutex
	running   sync.WaitGroup // one per Subscribe call still running
	closed    bool
	closing   chan struct{} // closed by Close
	closeOnce sync.Once
}

// start sets l up for b and registers it, to be closed with b.
func (l *lifecycle) start(b *Broker) error {
	l.b, l.closing = b, make(chan struct{})
	return b.register(l)
}

// started starts s's lifecycle on b and returns s.
func started[S interface {
	message.Subscriber
	start(b *Broker) error
}](b *Broker, s S) (message.Subscriber, error) {
	if err := s.start(b); err != nil {
		return nil, err
	}
	return s, nil
}

// lockOpen runs initialize for topic (provisioning), then locks mu for
// the caller to add a subscription; once l is closed it returns
// errSubscriberClosed, with mu unlocked.
func (l *lifecycle) lockOpen(initialize func(topic string) error, topic string) error {
	if err := initialize(topic); err != nil {
		return err
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return errSubscriberClosed
	}
	return nil
}

// Close stops every Subscribe call, waits until each has ended, and is
// idempotent. Nothing is acked by closing.
func (l *lifecycle) Close() error {
	l.mu.Lock()
	l.closed = true
	l.mu.Unlock()
	l.closeOnce.Do(func() { close(l.closing) })
	l.running.Wait()
	l.b.mu.Lock()
	l.b.subscribers = slices.DeleteFunc(l.b.subscribers, func(o io.Closer) bool { return o == l })
	l.b.mu.Unlock()
	return nil
}

// register keeps s, to close it with the Broker; it fails once the Broker
// is closed.
func (b *Broker) register(s io.Closer) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errBrokerClosed
	}
	b.subscribers = append(b.subscribers, s)
	return nil
}

// isClosed reports whether Close has been called.
func (s *subscriber) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// Subscribe provisions topic's stream and the group's consumer if needed and
// returns the group's messages of topic. The channel closes when ctx is done
// or the subscriber is closed; nothing is acked by that: messages handed out
// and not acked come back after ack_wait, the ones watermill-nats had taken
// but not handed out are nacked (back after nak_delay).
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.SubscribeInitialize(topic); err != nil {
		return nil, err
	}
	if s.isClosed() {
		return nil, errSubscriberClosed
	}
	if s.b.isClosed() {
		return nil, errBrokerClosed
	}
	sub, err := s.b.subscribe(ctx, s.group, topic)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		sub.stop()
		return nil, errSubscriberClosed
	}
	s.subs = append(s.subs, sub)
	s.mu.Unlock()
	go func() {
		<-sub.done
		s.mu.Lock()
		s.subs = slices.DeleteFunc(s.subs, func(o *subscription) bool { return o == sub })
		s.mu.Unlock()
	}()
	return sub.out, nil
}

// SubscribeInitialize provisions topic's stream and the group's consumer.
func (s *subscriber) SubscribeInitialize(topic string) error {
	return s.b.withinConnectTimeout(func(ctx context.Context) error {
		return s.b.Provision(ctx, topic, s.group)
	})
}

// Close stops every subscription without acking anything still unacked. It
// is idempotent.
func (s *subscriber) Close() error {
	var subs []*subscription
	if !adapterkit.MarkClosed(&s.mu, &s.closed, func() { subs = slices.Clone(s.subs) }) {
		return nil
	}

	errs := make([]error, len(subs))
	var wg sync.WaitGroup
	for i, sub := range subs {
		wg.Go(func() { errs[i] = sub.stop() })
	}
	wg.Wait()
	s.b.mu.Lock()
	s.b.subscribers = slices.DeleteFunc(s.b.subscribers, func(o io.Closer) bool { return o == s })
	s.b.mu.Unlock()
	return errors.Join(errs...)
}

// subscription is one Subscribe call: a watermill-nats subscriber on its own
// connection, and the goroutine that passes its messages on.
//
// It exists because of a race in watermill-nats v2.1.3: when the Subscribe
// context ends, its Subscriber closes the output channel right after
// unsubscribing, while nats.go may still be running a callback that is about
// to send a message on that channel ("send on closed channel", seen in
// Watermill's TestSubscribeCtx under -race). So the context given to
// watermill-nats never ends; a gate in the unmarshaler counts the messages
// that get past it, and on stop the gate closes, every message already past
// it is taken off the channel (and nacked), and only then is the
// watermill-nats subscriber closed.
type subscription struct {
	wm     *wmnats.Subscriber
	nc     *nats.Conn
	ncDone chan struct{} // closed when nc has closed
	gate   *gate
	out    chan *message.Message
	// nakDelay is how long the server waits before delivering a nacked
	// message again: a nacked message comes back after a pause, not at once.
	nakDelay time.Duration
	logger   watermill.LoggerAdapter
	// acks counts the goroutines that wait for a message's Ack or Nack and
	// confirm it to the server; quit, closed when closing starts, makes the
	// ones still waiting give up (the server delivers those messages again).
	acks sync.WaitGroup
	quit chan struct{}

	stopReq  chan struct{} // closed to ask the goroutine to stop
	stopOnce sync.Once
	done     chan struct{} // closed when stopped
	err      error
}

func (b *Broker) subscribe(ctx context.Context, group, topic string) (*subscription, error) {
	ncDone := make(chan struct{})
	nc, err := b.connect(context.Background(), "millrace-subscriber-"+group,
		nats.ClosedHandler(func(*nats.Conn) { close(ncDone) }))
	if err != nil {
		return nil, err
	}
	g := &gate{idle: make(chan struct{}), held: map[*message.Message]*nats.Msg{}}
	cc := b.cfg.Consumer
	durable := ConsumerName(group)
	wm, err := wmnats.NewSubscriberWithNatsConn(nc, wmnats.SubscriberSubscriptionConfig{
		Unmarshaler:      gatedUnmarshaler{g: g},
		SubscribersCount: cc.Subscribers,
		AckWaitTimeout:   cc.AckWait,
		CloseTimeout:     subscriberCloseTimeout,
		SubscribeTimeout: b.opts.ConnectTimeout,
		// The subject is the topic; the queue group is the consumer's deliver group.
		SubjectCalculator: func(queueGroup, topic string) *wmnats.SubjectDetail {
			return &wmnats.SubjectDetail{Primary: topic, QueueGroup: queueGroup}
		},
		QueueGroupPrefix: durable,
		JetStream: wmnats.JetStreamConfig{
			SubscribeOptions: []nats.SubOpt{
				// Without ManualAck nats.go acks every message when
				// watermill-nats's callback returns, which it also does on its
				// own ack timeout, on close and on an unmarshal error: a lost message.
				nats.ManualAck(),
				nats.AckExplicit(),
				nats.DeliverAll(),
			},
			// DurablePrefix alone names every topic's consumer the same;
			// here the name is the group's consumer on the subject's own
			// stream (one stream per topic, see StreamName), so each topic
			// and group pair is a consumer of its own, the one Provision made.
			DurablePrefix: durable,
			DurableCalculator: func(durable, _ string) string {
				return durable
			},
			AckAsync:   false, // AckSync: an ack counts once the server confirmed it
			TrackMsgId: true,
		},
	}, quietStopLogger{b.logger})
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("nats: %w", err)
	}
	wmOut, err := wm.Subscribe(context.Background(), topic)
	if err != nil {
		_ = wm.Close()
		nc.Close()
		return nil, fmt.Errorf("nats: subscribing group %q to topic %q: %w", group, topic, err)
	}
	sub := &subscription{
		wm: wm, nc: nc, ncDone: ncDone, gate: g,
		nakDelay: cc.NakDelay,
		logger:   b.logger,
		quit:     make(chan struct{}),
		out:      make(chan *message.Message),
		stopReq:  make(chan struct{}),
		done:     make(chan struct{}),
	}
	go sub.run(ctx, wmOut)
	return sub, nil
}

// run passes messages on until ctx ends or stop is asked for, then shuts
// the watermill-nats subscriber down safely.
func (s *subscription) run(ctx context.Context, wmOut <-chan *message.Message) {
	defer close(s.done)
	func() {
		defer close(s.out)
		for {
			select {
			case m := <-wmOut:
				s.confirm(m, s.gate.leave(m))
				select {
				case s.out <- m:
				case <-ctx.Done():
					m.Nack()
					return
				case <-s.stopReq:
					m.Nack()
					return
				}
			case <-ctx.Done():
				return
			case <-s.stopReq:
				return
			}
		}
	}()
	// No message gets past the gate any more; take off the channel the ones
	// already past it, so none is about to be sent when watermill-nats closes it.
	s.gate.close()
	for drained := false; !drained; {
		select {
		case m := <-wmOut:
			s.confirm(m, s.gate.leave(m))
			m.Nack()
		case <-s.gate.idle:
			drained = true
		}
	}
	close(s.quit)
	err := s.wm.Close()
	s.acks.Wait() // acks and nacks already asked for reach the server first
	if err != nil {
		s.nc.Close()
	}
	select {
	case <-s.ncDone:
	case <-time.After(subscriberCloseTimeout):
		s.nc.Close()
	}
	// A connection that is down or closed has nothing to drain.
	if err != nil && !errors.Is(err, nats.ErrConnectionClosed) && !errors.Is(err, nats.ErrConnectionReconnecting) {
		s.err = fmt.Errorf("nats: closing subscription: %w", err)
	}
}

// confirm sends m's Ack or Nack to the server on reply, in a goroutine of
// its own, once the handler has decided; a reply of nil (the message has no
// JetStream reply subject) needs nothing.
//
// watermill-nats would send it in its message callback, and so one ack the
// server never answers holds up every later message of the subscription for
// the ack's whole wait (5s). nats-server 2.10 and later do not answer an ack
// of a message past the consumer's delivered position, which is what the
// messages still queued in the client are after a server restart lost the
// consumer's unflushed state: a few dozen such messages stalled delivery for
// minutes. Here the callback returns as soon as the handler has decided, and
// the server's confirmation is waited for beside it.
func (s *subscription) confirm(m *message.Message, reply *nats.Msg) {
	if reply == nil {
		return
	}
	s.acks.Go(func() {
		select {
		case <-m.Acked():
		case <-m.Nacked():
		case <-s.quit:
		}
		// Decided before closing started (quit and a decision both ready): sent.
		select {
		case <-m.Acked():
			if err := reply.AckSync(); err != nil {
				s.logger.Error("Cannot send ack", err, watermill.LogFields{"message_uuid": m.UUID})
			}
		case <-m.Nacked():
			if err := reply.NakWithDelay(s.nakDelay); err != nil {
				s.logger.Error("Cannot send nak", err, watermill.LogFields{"message_uuid": m.UUID})
			}
		default:
		}
	})
}

// stop ends the subscription and waits until it has ended.
func (s *subscription) stop() error {
	s.stopOnce.Do(func() { close(s.stopReq) })
	<-s.done
	return s.err
}

// gate counts the messages between the unmarshaler and the output channel
// of a watermill-nats subscriber, and once closed lets no more through. It
// also holds each such message's JetStream reply (see subscription.confirm).
type gate struct {
	mu       sync.Mutex
	closed   bool
	inFlight int
	idle     chan struct{} // closed when the gate is closed and nothing is in flight
	held     map[*message.Message]*nats.Msg
}

func (g *gate) enter() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return false
	}
	g.inFlight++
	return true
}

// hold keeps reply, the message m was made of, for leave.
func (g *gate) hold(m *message.Message, reply *nats.Msg) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.held[m] = reply
}

// leave counts m out; it returns m's reply kept by hold, or nil.
func (g *gate) leave(m *message.Message) *nats.Msg {
	g.mu.Lock()
	defer g.mu.Unlock()
	reply := g.held[m]
	delete(g.held, m)
	g.inFlight--
	if g.closed && g.inFlight == 0 {
		close(g.idle)
	}
	return reply
}

func (g *gate) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = true
	if g.inFlight == 0 {
		close(g.idle)
	}
}

// errStopping is the unmarshal error of a message that arrives while its
// subscription stops: watermill-nats drops it unacked, and the server
// delivers it again after ack_wait.
var errStopping = errors.New("nats: subscription stopping, message left unacked")

// gatedUnmarshaler is the marshaler behind a gate.
type gatedUnmarshaler struct{ g *gate }

func (u gatedUnmarshaler) Unmarshal(nm *nats.Msg) (*message.Message, error) {
	if !u.g.enter() {
		return nil, errStopping
	}
	m, err := marshaler{}.Unmarshal(nm)
	if err != nil {
		u.g.leave(m) // watermill-nats drops it: it never reaches the channel
		return m, err
	}
	if nm.Reply != "" {
		// The subscription acks and nacks it (subscription.confirm); to
		// watermill-nats it is a message without a reply subject, whose
		// Ack and Nack it takes as done.
		reply := *nm
		u.g.hold(m, &reply)
		nm.Reply = ""
	}
	return m, err
}

// quietStopLogger logs errStopping, which is expected while stopping, at
// debug level instead of as an error.
type quietStopLogger struct{ watermill.LoggerAdapter }

func (l quietStopLogger) Error(msg string, err error, fields watermill.LogFields) {
	if errors.Is(err, errStopping) {
		l.Debug(msg+": "+err.Error(), fields)
		return
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l quietStopLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return quietStopLogger{l.LoggerAdapter.With(fields)}
}
