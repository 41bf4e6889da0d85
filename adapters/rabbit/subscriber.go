package rabbit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
)

// subscriber consumes one consumer group's queues. It is its own code rather
// than watermill-amqp's Subscriber because that one's ConnectionWrapper
// replaces its connection and "connected" channel from the reconnect
// goroutine while subscriptions read them unsynchronized (the race detector
// reports it on every broker restart), and because it turns a consumer
// cancellation (its queue deleted) into an empty message for the handler.
// The delivery semantics follow watermill-amqp: one message at a time per
// subscription, Ack -> basic.ack, Nack -> basic.nack with requeue, and a
// closing subscriber nacks what it holds. A spec with InFlight hands many
// out at once; an Ordered one too, and differs more: see consumeOrdered.
type subscriber struct {
	b     *Broker
	group string
	// inFlight, when positive, is how many messages a subscription hands
	// out at once without waiting for their acks (and the channel's
	// prefetch); 0 for one at a time, with Config.Prefetch.
	inFlight int
	// ordered hands out at most one message per aggregate at a time and
	// returns the unacked ones to the queue's head on a nack.
	ordered bool
	// wait, when set, is the spec's RedeliveryWait before a nacked
	// message's next delivery; deliveries then receives each message's
	// delivery number.
	wait       func(delivery int) time.Duration
	deliveries *adapters.Deliveries
	// parking is held (read) while a nacked message is parked and acked;
	// Close takes it before closing the connection, so a message being
	// parked is acked, not left in both queues.
	parking sync.RWMutex

	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup // running subscriptions

	mu     sync.Mutex
	closed bool
	conn   *amqp.Connection // this subscriber's connection; redialled when lost
}

var (
	_ message.Subscriber           = (*subscriber)(nil)
	_ message.SubscribeInitializer = (*subscriber)(nil)
)

// maxInFlight is the largest SubscriberSpec.InFlight: an AMQP prefetch
// count.
const maxInFlight = 65535

// Subscriber returns a subscriber for spec.Group, on a connection of its
// own (RabbitMQ's advice: consumers apart from publishers, which a resource
// alarm may block). Subscribing to a topic declares the topic's and the
// group's topology (as Provision does) and consumes the group's quorum queue
// with Config.Prefetch. Subscribers of one group compete for its messages;
// each group gets every message. A message is acked only by msg.Ack(); Nack,
// closing the subscriber or losing the connection redelivers it. After a
// connection loss each subscription reconnects by itself, with a backoff up
// to Config.ReconnectMaxInterval. A spec the Broker cannot serve
// (adapters.CheckSpec; InFlight is at most 65535, an AMQP prefetch count)
// is an *adapters.SpecError.
//
// With InFlight above 0, a subscription consumes the group's queue with a
// prefetch of InFlight (in place of Config.Prefetch) and hands deliveries
// out without waiting for the previous one's ack, so one subscription has
// up to InFlight messages in flight; each Ack is a basic.ack of its own
// delivery tag and each Nack a basic.nack with requeue. The stock
// subscriptions hold one message each.
//
// Ordered: as with InFlight, one per aggregate (the aggregate-id header) at
// a time: it holds the later ones of a busy aggregate, so none is handed
// out after its predecessor was nacked. Each Ack is a basic.ack of its own
// delivery tag, never `multiple`. A Nack is never a basic.nack, which lets
// newer messages of a quorum queue pass the nacked one: the subscription
// stops handing out, waits until what it handed out is settled, and closes
// its channel, and the quorum queue puts the unacked messages (the nacked
// ones and those prefetched but not handed out) back at its head in their
// delivery order; then it consumes again on a new channel. Closing the
// subscriber, a crash or a lost connection return the unacked messages the
// same way. Each such return counts as a delivery of every message returned
// (x-delivery-count, Config.DeliveryLimit).
//
// With a RedeliveryWait, a nacked message waits RedeliveryWait(n) before
// its next delivery, n being the number of the delivery that was nacked (1
// for the first), and spec.Deliveries receives each message's delivery
// number. The wait is not spent in the group's queue (a quorum queue
// delivers a nacked message again at once): the message is published, with
// publisher confirms, to the group's retry queue (RetryQueueName) with an
// expiration of RedeliveryWait(n) and the header DeliveryNumberKey = n+1,
// and only then acked; RabbitMQ dead-letters it back to the group's queue
// when it expires. A crash between the confirm and the ack leaves both
// copies (the inbox drops the duplicate), never none. If the retry queue
// cannot take it, the message is nacked as without a RedeliveryWait. The
// delivery number is the header's (1 when absent) plus the queue's
// x-delivery-count, so deliveries cut short by a consumer crash or restart
// count too. A retry queue expires messages only at its head, so a message
// can wait longer than RedeliveryWait(n), as long as the longest wait
// queued before it (at most retry.max_interval); never shorter. A wait of 0
// or less nacks the message for an immediate redelivery.
func (b *Broker) Subscriber(spec adapters.SubscriberSpec) (message.Subscriber, error) {
	if err := adapters.CheckSpec(Kind, b.Capabilities(), spec, maxInFlight); err != nil {
		return nil, err
	}
	return b.newSubscriber(spec)
}

func (b *Broker) newSubscriber(spec adapters.SubscriberSpec) (message.Subscriber, error) {
	consumerGroup := spec.Group
	if err := checkGroup(consumerGroup); err != nil {
		return nil, err
	}
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, errClosed
	}
	s := &subscriber{b: b, group: consumerGroup, wait: spec.RedeliveryWait, deliveries: spec.Deliveries,
		inFlight: spec.InFlight, ordered: spec.Ordered, closing: make(chan struct{})}
	if _, err := s.connection(context.Background()); err != nil {
		return nil, err
	}
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		_ = s.Close()
		return nil, errClosed
	}
	b.subs[s] = struct{}{}
	b.mu.Unlock()
	return s, nil
}

// connection returns the subscriber's connection, dialling a new one when
// there is none or it was lost.
func (s *subscriber) connection(ctx context.Context) (*amqp.Connection, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return liveConn(s.closed, errSubscriberClosed, &s.conn, func() (*amqp.Connection, error) {
		conn, err := s.b.dial(ctx, "subscriber "+s.group)
		if err != nil {
			return nil, fmt.Errorf("rabbitmq: subscriber for group %q: connect to %s: %w", s.group, s.b.redacted, err)
		}
		return conn, nil
	})
}

var errSubscriberClosed = errors.New("rabbitmq: subscriber is closed")

// declare declares topic's and the group's topology on a channel of conn.
func (s *subscriber) declare(conn *amqp.Connection, topic string) error {
	tc := &topoChannel{conn: conn}
	defer tc.close()
	if err := s.b.declarer.declareTopic(tc, topic); err != nil {
		return err
	}
	return s.b.declarer.declareGroup(tc, topic, s.group)
}

// SubscribeInitialize declares topic's and the group's topology without
// consuming, so messages published from now on wait in the group's queue.
func (s *subscriber) SubscribeInitialize(topic string) error {
	if err := checkNames(topic, s.group); err != nil {
		return err
	}
	conn, err := s.connection(context.Background())
	if err != nil {
		return err
	}
	return s.declare(conn, topic)
}

// Subscribe declares topic's and the group's topology and returns the
// group's messages until ctx ends or the subscriber closes; then the channel
// is closed. A topology conflict is returned at once.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := checkNames(topic, s.group); err != nil {
		return nil, err
	}
	conn, err := s.connection(ctx)
	if err != nil {
		return nil, err
	}
	if err := s.declare(conn, topic); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, errSubscriberClosed
	}
	out := make(chan *message.Message)
	s.wg.Add(1)
	go s.run(ctx, topic, out)
	return out, nil
}

// run consumes until ctx ends or the subscriber closes, reconnecting with
// backoff whenever the channel or connection is lost.
func (s *subscriber) run(ctx context.Context, topic string, out chan<- *message.Message) {
	defer s.wg.Done()
	defer close(out)
	logFields := watermill.LogFields{"topic": topic, "consumer_group": s.group, "queue": QueueName(topic, s.group)}
	bo := &backoff.ExponentialBackOff{
		InitialInterval:     100 * time.Millisecond,
		RandomizationFactor: 0.5,
		Multiplier:          2,
		MaxInterval:         s.b.cfg.ReconnectMaxInterval,
	}
	for {
		consumed, err := s.consume(ctx, topic, out)
		if s.stopping(ctx) {
			return
		}
		if errors.Is(err, errReturned) {
			// A nack of an ordered subscription: consume again at once.
			bo.Reset()
			continue
		}
		if consumed {
			bo.Reset()
		}
		wait := bo.NextBackOff()
		s.b.opts.Logger.Error("RabbitMQ subscription interrupted, resuming", err, logFields.Add(watermill.LogFields{"retry_in": wait.String()}))
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return
		case <-s.closing:
			return
		}
	}
}

func (s *subscriber) stopping(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return true
	case <-s.closing:
		return true
	default:
		return false
	}
}

// consume runs one consumer on a fresh channel until it ends. consumed
// reports whether it got as far as consuming (the backoff then restarts).
func (s *subscriber) consume(ctx context.Context, topic string, out chan<- *message.Message) (consumed bool, err error) {
	conn, err := s.connection(ctx)
	if err != nil {
		return false, err
	}
	// The topology is declared again: a queue deleted while we were away
	// comes back, and with it the group's binding.
	if err := s.declare(conn, topic); err != nil {
		return false, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return false, fmt.Errorf("rabbitmq: open channel on %s: %w", s.b.redacted, err)
	}
	defer ch.Close()
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	prefetch := s.b.cfg.Prefetch
	if s.inFlight > 0 {
		prefetch = s.inFlight
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return false, fmt.Errorf("rabbitmq: set prefetch %d: %w", prefetch, err)
	}
	queue := QueueName(topic, s.group)
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return false, fmt.Errorf("rabbitmq: consume queue %q: %w", queue, err)
	}
	if s.ordered {
		return true, s.consumeOrdered(ctx, ch, queue, deliveries, closes, out)
	}
	// A concurrent subscription's messages are settled from goroutines of
	// their own, which need the channel: consume waits for them before it
	// returns at the end of ctx (the channel closes then), unless the
	// subscriber closes, which returns what is unacked to the queue.
	var settling sync.WaitGroup
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return true, consumeEnded(ch, queue, closes)
			}
			msg, endCtx, ok := s.handOut(ctx, d, out)
			if !ok {
				return true, nil
			}
			if s.inFlight == 0 {
				s.settle(topic, d, msg, endCtx)
				break
			}
			settling.Add(1)
			s.wg.Go(func() { defer settling.Done(); s.settle(topic, d, msg, endCtx) })
		case e := <-closes:
			return true, fmt.Errorf("rabbitmq: channel closed: %w", e)
		case <-ctx.Done():
			settled := make(chan struct{})
			go func() { settling.Wait(); close(settled) }()
			select {
			case <-settled:
			case <-s.closing:
			}
			return true, nil
		case <-s.closing:
			return true, nil
		}
	}
}

// consumeEnded is why the deliveries of queue on ch ended: the channel
// closed, or the broker cancelled the consumer (its queue was deleted).
func consumeEnded(ch *amqp.Channel, queue string, closes <-chan *amqp.Error) error {
	select {
	case e, ok := <-closes:
		if ok && e != nil {
			return fmt.Errorf("rabbitmq: channel closed: %w", e)
		}
	default:
	}
	if ch.IsClosed() {
		return errors.New("rabbitmq: channel closed")
	}
	return fmt.Errorf("rabbitmq: consumer of queue %q cancelled by the broker", queue)
}

// errReturned ends an ordered consumer whose channel was closed to return
// its unacked messages to the head of the queue after a Nack.
var errReturned = errors.New("rabbitmq: unacked messages returned to the queue after a nack")

// consumeOrdered is consume's loop for an ordered subscriber. It hands out
// deliveries without waiting for the previous one's ack (the channel's
// prefetch bounds how many are unsettled), but at most one per aggregate
// (the aggregate-id header) at a time: the next of an aggregate is handed
// out only after this loop saw the previous one acked. That is what keeps a
// Nack safe: the reader may take a message the moment it is handed out, so
// a later message of a nacked one's aggregate must never be handed out once
// the nack happened, and only the loop's own view of the settlement orders
// the two. Each delivery is settled from a goroutine of its own; an Ack acks
// its delivery tag alone.
//
// On the first Nack it hands out nothing more, waits until everything
// handed out is settled (the acks of other messages still go out), and
// returns errReturned; consume's deferred Close
// then makes the quorum queue return the unacked messages to its head, in
// delivery order. A basic.nack would requeue the message behind newer ones.
// It returns nil when ctx ends or the subscriber closes: closing the
// connection returns the unacked messages the same way.
func (s *subscriber) consumeOrdered(ctx context.Context, ch *amqp.Channel, queue string, deliveries <-chan amqp.Delivery, closes <-chan *amqp.Error, out chan<- *message.Message) error {
	q := newOrderedQueue(ctx, s)
	defer q.cancelAll()
	nacked := false
	for {
		var send chan<- *message.Message
		var next *message.Message
		if len(q.ready) > 0 && !nacked {
			send, next = out, q.ready[0]
		}
		var recv <-chan amqp.Delivery
		if !nacked {
			recv = deliveries
		}
		select {
		case d, ok := <-recv:
			if !ok {
				return consumeEnded(ch, queue, closes)
			}
			q.accept(d)
		case send <- next:
			q.handedOut()
		case st := <-q.settled:
			if !q.settle(st) {
				nacked = true
			}
		case e := <-closes:
			return fmt.Errorf("rabbitmq: channel closed: %w", e)
		case <-ctx.Done():
			q.drain()
			return nil
		case <-s.closing:
			return nil
		}
		if nacked {
			q.drain()
			if s.stopping(ctx) {
				return nil
			}
			// The close may return some messages acked just before it too
			// (the quorum queue applies acks asynchronously; the test sees
			// them as duplicates, which the inbox drops, in order). A
			// basic.cancel before the close, tried, broke the order.
			s.b.opts.Logger.Info("Ordered RabbitMQ subscription returns its unacked messages to the queue after a nack", watermill.LogFields{"consumer_group": s.group, "queue": queue})
			return errReturned
		}
	}
}

// orderedSettlement is a handed-out message's outcome.
type orderedSettlement struct {
	key   string
	acked bool
}

// orderedQueue is what consumeOrdered holds: the deliveries ready to hand
// out and, per busy aggregate, those waiting behind the one handed out.
type orderedQueue struct {
	ctx       context.Context
	s         *subscriber
	ready     []*message.Message         // to hand out, in delivery order
	waiting   map[string][]amqp.Delivery // per busy aggregate, behind the one handed out
	outCancel map[*message.Message]context.CancelFunc
	outTag    map[*message.Message]amqp.Delivery
	unsettled int
	// Each settling goroutine reports once; the buffer (the prefetch) means
	// it never blocks, even after consumeOrdered returned.
	settled chan orderedSettlement
}

func newOrderedQueue(ctx context.Context, s *subscriber) *orderedQueue {
	return &orderedQueue{
		ctx:       ctx,
		s:         s,
		waiting:   map[string][]amqp.Delivery{},
		outCancel: map[*message.Message]context.CancelFunc{},
		outTag:    map[*message.Message]amqp.Delivery{},
		settled:   make(chan orderedSettlement, s.inFlight),
	}
}

// cancelAll ends the contexts of the messages not handed out: they return
// with the channel.
func (q *orderedQueue) cancelAll() {
	for _, cancel := range q.outCancel {
		cancel()
	}
}

// accept makes d ready to hand out, or queues it behind its busy aggregate.
func (q *orderedQueue) accept(d amqp.Delivery) {
	key := headerString(d.Headers[envelope.AggregateIDKey])
	if queued, busy := q.waiting[key]; busy {
		q.waiting[key] = append(queued, d)
		return
	}
	q.waiting[key] = nil
	q.prepare(d)
}

// prepare makes d a message ready to hand out.
func (q *orderedQueue) prepare(d amqp.Delivery) {
	msg, _ := Marshaler{}.Unmarshal(d) // never fails; see Marshaler
	msgCtx, cancel := context.WithCancel(q.ctx)
	msg.SetContext(msgCtx)
	q.outCancel[msg], q.outTag[msg] = cancel, d
	q.ready = append(q.ready, msg)
}

// handedOut records that the first ready message went out and settles it
// from a goroutine of its own.
func (q *orderedQueue) handedOut() {
	next := q.ready[0]
	q.ready[0] = nil
	q.ready = q.ready[1:]
	d, cancel := q.outTag[next], q.outCancel[next]
	delete(q.outTag, next)
	delete(q.outCancel, next)
	q.unsettled++
	key := next.Metadata.Get(envelope.AggregateIDKey)
	go func(msg *message.Message) {
		defer cancel()
		q.settled <- orderedSettlement{key: key, acked: q.s.settleOrdered(d, msg)}
	}(next)
}

// settle applies st: an ack frees its aggregate for the next delivery
// waiting behind it. It reports false for a nack.
func (q *orderedQueue) settle(st orderedSettlement) bool {
	q.unsettled--
	if !st.acked {
		return false
	}
	if queued := q.waiting[st.key]; len(queued) > 0 {
		q.waiting[st.key] = queued[1:]
		q.prepare(queued[0])
	} else {
		delete(q.waiting, st.key)
	}
	return true
}

// drain waits until what was handed out is settled, or the subscriber
// closes: the acks need the channel, which consume closes on return.
func (q *orderedQueue) drain() {
	for q.unsettled > 0 {
		select {
		case <-q.settled:
			q.unsettled--
		case <-q.s.closing:
			return
		}
	}
}

// settleOrdered settles the delivery d, handed out as msg, of an ordered
// subscriber and reports whether msg was acked: an Ack acks its delivery tag
// alone; a Nack leaves d unacked, for the channel's close to return it. A
// failed ack means the channel is gone, and the broker returns the message
// with the others. A close of the subscriber counts as a nack.
func (s *subscriber) settleOrdered(d amqp.Delivery, msg *message.Message) bool {
	select {
	case <-msg.Acked():
		_ = d.Ack(false)
		return true
	case <-msg.Nacked():
		return false
	case <-s.closing:
		// An ack given just before the close still goes out first.
		select {
		case <-msg.Acked():
			_ = d.Ack(false)
			return true
		default:
			return false
		}
	}
}

// handOut hands d to the subscription's reader as a message, with the
// function that ends its context, and reports false, with d unsettled, when
// the subscription stops first. A stopping subscription leaves d unsettled:
// the channel closing after it returns d to the queue, counted once in
// x-delivery-count. A nack with requeue would return it as well, and the
// queue could hand it to this channel again before it closes, counting two
// deliveries.
func (s *subscriber) handOut(ctx context.Context, d amqp.Delivery, out chan<- *message.Message) (*message.Message, context.CancelFunc, bool) {
	msg, _ := Marshaler{}.Unmarshal(d) // never fails; see Marshaler
	msgCtx, cancel := context.WithCancel(ctx)
	msg.SetContext(msgCtx)
	if s.wait != nil {
		end, forget := cancel, s.deliveries.Record(msg, deliveryNumber(d))
		cancel = func() { end(); forget() }
	}
	select {
	case out <- msg:
		return msg, cancel, true
	case <-ctx.Done():
	case <-s.closing:
	}
	cancel()
	return nil, nil, false
}

// settle settles d, handed out as msg, with the broker as the reader
// decides, and then ends msg's context with endCtx. A message handed over
// is settled by its reader even after the subscription's context ended, so
// a handler finishing during shutdown still gets its Ack through. An Ack or Nack that fails means the channel is
// gone: the broker redelivers the message, and the consume loop sees the
// close. A closing subscriber leaves it unsettled, as handOut does.
func (s *subscriber) settle(topic string, d amqp.Delivery, msg *message.Message, endCtx context.CancelFunc) {
	defer endCtx()
	select {
	case <-msg.Acked():
		_ = d.Ack(false)
	case <-msg.Nacked():
		if s.wait != nil {
			s.retryLater(topic, d, deliveryNumber(d))
			return
		}
		_ = d.Nack(false, true)
	case <-s.closing:
		select {
		case <-msg.Acked(): // an Ack given just before the close still goes out
			_ = d.Ack(false)
		default:
		}
	}
}

// DeliveryNumberKey is the header ("x-millrace-delivery") a
// subscription with a RedeliveryWait sets on a message it parks in the retry queue: the
// number of the delivery that comes when the wait ends. It reaches the
// handler as metadata and is never published with an event.
const DeliveryNumberKey = "x-millrace-delivery"

// deliveryNumber is d's delivery number: DeliveryNumberKey (1 when absent)
// plus the quorum queue's redeliveries of this copy (x-delivery-count).
func deliveryNumber(d amqp.Delivery) int {
	n := max(headerInt(d.Headers[DeliveryNumberKey]), 1)
	redelivered := headerInt(d.Headers[DeliveryCountKey])
	if redelivered == 0 && d.Redelivered {
		redelivered = 1
	}
	return n + redelivered
}

// headerInt reads an integer header as the broker returns it (a client may
// have sent any integer type), 0 when absent or not an integer.
func headerInt(v any) int {
	switch v := v.(type) {
	case int64:
		return int(min(max(v, 0), math.MaxInt32))
	case int32:
		return int(max(v, 0))
	case int16:
		return int(max(v, 0))
	case int8:
		return int(max(v, 0))
	case int:
		return max(v, 0)
	case uint8:
		return int(v)
	case uint16:
		return int(v)
	case uint32:
		return int(min(v, math.MaxInt32))
	default:
		return 0
	}
}

// retryLater settles the nacked delivery d, number n, of topic: parked in
// the group's retry queue for s.wait(n), then acked; nacked for an
// immediate redelivery when the wait is not positive or the retry queue did
// not confirm the copy.
func (s *subscriber) retryLater(topic string, d amqp.Delivery, n int) {
	s.parking.RLock()
	defer s.parking.RUnlock()
	wait := s.wait(n)
	if wait <= 0 {
		_ = d.Nack(false, true)
		return
	}
	if err := s.b.park(RetryQueueName(topic, s.group), d, n+1, wait); err != nil {
		s.b.opts.Logger.Error("Could not park a message in the retry queue; redelivering it at once", err, watermill.LogFields{
			"topic": topic, "consumer_group": s.group, "message_uuid": d.MessageId, "delivery": n,
		})
		_ = d.Nack(false, true)
		return
	}
	_ = d.Ack(false)
}

// park publishes a copy of d to the retry queue queue, expiring after wait,
// with DeliveryNumberKey next, and waits for the broker's confirm. It
// publishes on the Broker's publishing connection, as RabbitMQ advises
// (a resource alarm blocks publishing connections, and consumers apart
// from them keep acking).
func (b *Broker) park(queue string, d amqp.Delivery, next int, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), b.opts.ConnectTimeout)
	defer cancel()
	conn, err := b.connection(ctx)
	if err != nil {
		return err
	}
	cc, err := b.takeChannel(conn)
	if err != nil {
		return err
	}
	headers := make(amqp.Table, len(d.Headers)+1)
	for k, v := range d.Headers {
		// RabbitMQ's own headers describe the delivery, not the message.
		if !brokerHeader(k) {
			headers[k] = v
		}
	}
	headers[DeliveryNumberKey] = int64(next)
	ms := max((wait+time.Millisecond-1)/time.Millisecond, 1)
	pub := amqp.Publishing{
		Headers:         headers,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		Expiration:      strconv.FormatInt(int64(ms), 10),
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		// UserId is left out: RabbitMQ refuses a user-id other than the
		// publishing connection's user.
		Body: d.Body,
	}
	dc, err := cc.ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, pub)
	if err != nil {
		_ = cc.ch.Close()
		return fmt.Errorf("rabbitmq: publish message %s to retry queue %q: %w", d.MessageId, queue, err)
	}
	select {
	case <-dc.Done():
	case <-ctx.Done():
		_ = cc.ch.Close()
		return fmt.Errorf("rabbitmq: retry queue %q did not confirm message %s: %w", queue, d.MessageId, ctx.Err())
	}
	if !dc.Acked() {
		_ = cc.ch.Close()
		return fmt.Errorf("rabbitmq: message %s to retry queue %q: %w", d.MessageId, queue, ErrNacked)
	}
	// Every basic.return precedes its message's confirm.
	for {
		select {
		case r := <-cc.returns:
			if r.RoutingKey == queue && r.MessageId == d.MessageId {
				_ = cc.ch.Close()
				return fmt.Errorf("rabbitmq: message %s came back from retry queue %q (%s): %w", d.MessageId, queue, r.ReplyText, ErrUnroutable)
			}
			continue
		default:
		}
		break
	}
	b.putChannel(cc)
	return nil
}

// Close stops every subscription (a message handed out but not acked is
// redelivered, never acked) and closes the subscriber's connection. It is
// idempotent.
func (s *subscriber) Close() error {
	var conn *amqp.Connection
	s.closeOnce.Do(func() {
		s.parking.Lock() // waits for a message being parked (bounded by its publish timeout)
		defer s.parking.Unlock()
		s.mu.Lock()
		s.closed = true
		close(s.closing)
		conn, s.conn = s.conn, nil
		s.mu.Unlock()
	})
	s.b.mu.Lock()
	delete(s.b.subs, s)
	s.b.mu.Unlock()
	// Closing the connection first also ends a declaration or consume call
	// that waits for a broker that stopped answering.
	var err error
	if conn != nil && !conn.IsClosed() {
		if cerr := conn.CloseDeadline(time.Now().Add(s.b.opts.ConnectTimeout)); cerr != nil && !errors.Is(cerr, amqp.ErrClosed) {
			err = fmt.Errorf("rabbitmq: close subscriber connection to %s: %w", s.b.redacted, cerr)
		}
	}
	s.wg.Wait()
	return err
}
