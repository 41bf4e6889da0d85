package nats

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/millrace-io/millrace/adapters"
)

// subscribeConcurrent is Subscriber for an unordered spec with InFlight
// or a RedeliveryWait (adapters.Capabilities.ConcurrentFlight,
// ScheduledRedelivery): one subscription on the group's durable consumer
// hands messages out without waiting for the previous one's ack, up to
// InFlight (at least 1) unsettled at once (the consumer's max_ack_pending
// bounds what the server sends the whole group), and settles each on its
// own: an Ack is a confirmed ack of its message, a Nack makes the server
// deliver it again after consumer.nak_delay, or with a RedeliveryWait after
// RedeliveryWait(n), n being the message's JetStream delivery count
// (NumDelivered, kept by the server across consumer restarts), which
// spec.Deliveries receives. A wait of 0 or less redelivers at once. The
// stock subscription's watermill-nats subscriptions hold one message each.
//
// Messages the server sent beyond InFlight wait in the subscription, kept
// from reaching ack_wait (InProgress); when the subscription stops they are
// nacked for an immediate redelivery, which counts as a delivery. A message
// handed out and not settled when the subscriber closes comes again after
// ack_wait.
func (b *Broker) subscribeConcurrent(spec adapters.SubscriberSpec) (message.Subscriber, error) {
	return started(b, &concurrentSubscriber{group: spec.Group, inFlight: max(spec.InFlight, 1), wait: spec.RedeliveryWait, deliveries: spec.Deliveries})
}

// concurrentSubscriber is subscribeConcurrent's message.Subscriber.
type concurrentSubscriber struct {
	lifecycle
	group    string
	inFlight int
	// wait is the nak delay of a delivery by its number; nil for
	// consumer.nak_delay and no delivery numbers.
	wait       func(delivery int) time.Duration
	deliveries *adapters.Deliveries // with wait: each message's delivery number
}

var _ message.SubscribeInitializer = (*concurrentSubscriber)(nil)

// SubscribeInitialize provisions topic's stream and the group's consumer.
func (s *concurrentSubscriber) SubscribeInitialize(topic string) error {
	return s.b.withinConnectTimeout(func(ctx context.Context) error {
		return s.b.Provision(ctx, topic, s.group)
	})
}

// Subscribe provisions topic's stream and the group's consumer if needed and
// returns the group's messages of topic, until ctx ends or the subscriber
// closes; then the channel is closed.
func (s *concurrentSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.lockOpen(s.SubscribeInitialize, topic); err != nil {
		return nil, err
	}
	defer s.mu.Unlock()
	b := s.b
	infoCtx, cancel := context.WithTimeout(ctx, b.opts.ConnectTimeout)
	defer cancel()
	stream := StreamName(topic)
	// The consumer's own deliver subject and group, as the server has them.
	c, err := b.js.PushConsumer(infoCtx, stream, ConsumerName(s.group))
	if err != nil {
		return nil, fmt.Errorf("nats: reading consumer of group %q on topic %q: %w", s.group, topic, err)
	}
	cfg := c.CachedInfo().Config
	ncClosed := make(chan struct{})
	nc, err := b.connect(ctx, "millrace-subscriber-"+s.group, nats.ClosedHandler(func(*nats.Conn) { close(ncClosed) }))
	if err != nil {
		return nil, err
	}
	// Room for everything the server may push at once: the loop reads on
	// at once, but a full channel would drop a message until ack_wait.
	msgs := make(chan *nats.Msg, max(cfg.MaxAckPending, s.inFlight)+64)
	natsSub, err := nc.ChanQueueSubscribe(cfg.DeliverSubject, cfg.DeliverGroup, msgs)
	if err == nil {
		err = nc.FlushWithContext(infoCtx)
	}
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("nats: subscribing group %q to topic %q: %w", s.group, topic, err)
	}
	sub := &concurrentSubscription{
		s:        s,
		nc:       nc,
		natsSub:  natsSub,
		msgs:     msgs,
		ncClosed: ncClosed,
		out:      make(chan *message.Message),
		quit:     make(chan struct{}),
		logger:   b.logger.With(watermill.LogFields{"consumer_group": s.group, "topic": topic}),
	}
	s.running.Go(func() { sub.run(ctx) })
	return sub.out, nil
}

// concurrentSubscription is one Subscribe call of a concurrentSubscriber,
// on a connection of its own.
type concurrentSubscription struct {
	s        *concurrentSubscriber
	nc       *nats.Conn
	natsSub  *nats.Subscription
	msgs     chan *nats.Msg
	ncClosed chan struct{}
	out      chan *message.Message
	logger   watermill.LoggerAdapter
	// settling counts the goroutines that wait for a handed-out message's
	// Ack or Nack and send it to the server; quit, closed when the
	// subscription stops, makes those still waiting give up.
	settling sync.WaitGroup
	quit     chan struct{}
}

// waitingMsg is a delivery received and not handed out yet.
type waitingMsg struct {
	reply  *nats.Msg
	msg    *message.Message
	endCtx context.CancelFunc // ends msg's context once it is settled
	touch  time.Time          // when the server last heard of it
}

// run hands the deliveries out, at most inFlight unsettled at once, until
// ctx ends, the subscriber closes or the connection closes; then it stops
// (see stop).
func (c *concurrentSubscription) run(ctx context.Context) {
	s := c.s
	ackWait := s.b.cfg.Consumer.AckWait
	var (
		waiting   []*waitingMsg
		unsettled int
	)
	// One value per handed-out message once its reader decided; never more
	// than inFlight are unsettled, so a sender never blocks.
	decided := make(chan struct{}, s.inFlight)
	// Waiting messages must not reach ack_wait: the server would deliver
	// them again.
	progress := time.NewTicker(max(ackWait/3, time.Millisecond))
	defer progress.Stop()
	defer func() { c.stop(waiting) }()
	for {
		var send chan<- *message.Message
		var next *message.Message
		if len(waiting) > 0 && unsettled < s.inFlight {
			send, next = c.out, waiting[0].msg
		}
		select {
		case nm := <-c.msgs:
			if w := c.receive(ctx, nm); w != nil {
				waiting = append(waiting, w)
			}
		case send <- next:
			w := waiting[0]
			waiting[0] = nil
			waiting = waiting[1:]
			unsettled++
			c.settling.Go(func() { c.settle(w, decided) })
		case <-decided:
			unsettled--
		case <-progress.C:
			for _, w := range waiting {
				if time.Since(w.touch) >= ackWait/3 {
					_ = w.reply.InProgress()
					w.touch = time.Now()
				}
			}
		case <-ctx.Done():
			return
		case <-s.closing:
			return
		case <-c.ncClosed:
			return
		}
	}
}

// receive makes nm a message to hand out, or returns nil for a message
// that is not a JetStream delivery (nothing to settle).
func (c *concurrentSubscription) receive(ctx context.Context, nm *nats.Msg) *waitingMsg {
	md, err := nm.Metadata()
	if err != nil {
		return nil
	}
	msg, _ := marshaler{}.Unmarshal(nm) // never fails; see marshaler
	msgCtx, cancel := context.WithCancel(ctx)
	msg.SetContext(msgCtx)
	end := context.CancelFunc(cancel)
	if c.s.wait != nil {
		forget := c.s.deliveries.Record(msg, int(min(md.NumDelivered, math.MaxInt32)))
		end = func() { cancel(); forget() }
	}
	return &waitingMsg{reply: nm, msg: msg, endCtx: end, touch: time.Now()}
}

// settle waits for the reader's decision on w, reports it on decided, and
// sends it to the server: an Ack waiting for the server's confirmation, a
// Nack as a nak delayed by the delivery's wait; then it ends the message's
// context. A message still undecided when the subscription stops is left
// unacked.
func (c *concurrentSubscription) settle(w *waitingMsg, decided chan<- struct{}) {
	defer w.endCtx()
	select {
	case <-w.msg.Acked():
	case <-w.msg.Nacked():
	case <-c.quit:
	}
	decided <- struct{}{}
	// Decided before the stop (quit and a decision both ready): sent.
	select {
	case <-w.msg.Acked():
		if err := w.reply.Ack(); err != nil {
			// The effect is done; the message comes again, as a duplicate.
			c.logger.Error("Cannot send ack", err, watermill.LogFields{"message_uuid": w.msg.UUID})
		}
	case <-w.msg.Nacked():
		if err := nak(w.reply, c.nakDelay); err != nil {
			c.logger.Error("Cannot send nak", err, watermill.LogFields{"message_uuid": w.msg.UUID})
		}
	default:
	}
}

// nakDelay is how long the server waits before it delivers a nacked
// message again, by the number of the delivery that was nacked.
func (c *concurrentSubscription) nakDelay(delivery uint64) time.Duration {
	if c.s.wait == nil {
		return c.s.b.cfg.Consumer.NakDelay
	}
	return c.s.wait(int(min(delivery, math.MaxInt32)))
}

// nak tells the server to deliver reply's message again after delay(n), n
// being its delivery count; at once when that is not positive.
func nak(reply *nats.Msg, delay func(delivered uint64) time.Duration) error {
	md, err := reply.Metadata()
	if err != nil {
		return reply.Nak()
	}
	if d := delay(md.NumDelivered); d > 0 {
		return reply.NakWithDelay(d)
	}
	return reply.Nak()
}

// stop unsubscribes, nacks the messages received and not handed out (and
// those still on their way from the connection) for an immediate
// redelivery, waits for the settlements already decided to reach the
// server, and closes the connection and the output channel.
func (c *concurrentSubscription) stop(waiting []*waitingMsg) {
	defer close(c.out)
	_ = c.natsSub.Unsubscribe()
	for _, w := range waiting {
		_ = w.reply.Nak()
		w.endCtx()
	}
	for drained := false; !drained; {
		select {
		case nm := <-c.msgs:
			if _, err := nm.Metadata(); err == nil {
				_ = nm.Nak()
			}
		default:
			drained = true
		}
	}
	close(c.quit)
	c.settling.Wait()
	if err := c.nc.FlushTimeout(c.s.b.opts.ConnectTimeout); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		c.logger.Info("Could not flush the naks of a stopping subscription; the server delivers those messages again after ack_wait", watermill.LogFields{"err": err.Error()})
	}
	c.nc.Close()
}
