package rabbit

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v5"
	amqp "github.com/rabbitmq/amqp091-go"
)

// subscriber consumes one consumer group's queues. It is its own code rather
// than watermill-amqp's Subscriber because that one's ConnectionWrapper
// replaces its connection and "connected" channel from the reconnect
// goroutine while subscriptions read them unsynchronized (the race detector
// reports it on every broker restart), and because it turns a consumer
// cancellation (its queue deleted) into an empty message for the handler.
// The delivery semantics follow watermill-amqp: one message at a time per
// subscription, Ack -> basic.ack, Nack -> basic.nack with requeue, and a
// closing subscriber nacks what it holds.
type subscriber struct {
	b     *Broker
	group string

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

// Subscriber returns a subscriber for consumerGroup, on a connection of its
// own (RabbitMQ's advice: consumers apart from publishers, which a resource
// alarm may block). Subscribing to a topic declares the topic's and the
// group's topology (as Provision does) and consumes the group's quorum queue
// with Config.Prefetch. Subscribers of one group compete for its messages;
// each group gets every message. A message is acked only by msg.Ack(); Nack,
// closing the subscriber or losing the connection redelivers it. After a
// connection loss each subscription reconnects by itself, with a backoff up
// to Config.ReconnectMaxInterval.
func (b *Broker) Subscriber(consumerGroup string) (message.Subscriber, error) {
	if err := checkGroup(consumerGroup); err != nil {
		return nil, err
	}
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, errClosed
	}
	s := &subscriber{b: b, group: consumerGroup, closing: make(chan struct{})}
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
	if s.closed {
		return nil, errSubscriberClosed
	}
	if s.conn != nil && !s.conn.IsClosed() {
		return s.conn, nil
	}
	conn, err := s.b.dial(ctx, "subscriber "+s.group)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: subscriber for group %q: connect to %s: %w", s.group, s.b.redacted, err)
	}
	s.conn = conn
	return conn, nil
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
	if err := ch.Qos(s.b.cfg.Prefetch, 0, false); err != nil {
		return false, fmt.Errorf("rabbitmq: set prefetch %d: %w", s.b.cfg.Prefetch, err)
	}
	queue := QueueName(topic, s.group)
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return false, fmt.Errorf("rabbitmq: consume queue %q: %w", queue, err)
	}
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				// The channel closed, or the broker cancelled the consumer
				// (its queue was deleted).
				select {
				case e, ok := <-closes:
					if ok && e != nil {
						return true, fmt.Errorf("rabbitmq: channel closed: %w", e)
					}
				default:
				}
				if ch.IsClosed() {
					return true, errors.New("rabbitmq: channel closed")
				}
				return true, fmt.Errorf("rabbitmq: consumer of queue %q cancelled by the broker", queue)
			}
			if !s.deliver(ctx, d, out) {
				return true, nil
			}
		case e := <-closes:
			return true, fmt.Errorf("rabbitmq: channel closed: %w", e)
		case <-ctx.Done():
			return true, nil
		case <-s.closing:
			return true, nil
		}
	}
}

// deliver hands d to the subscription's reader and settles it with the
// broker as the reader decides. It reports false when the subscription is
// stopping.
func (s *subscriber) deliver(ctx context.Context, d amqp.Delivery, out chan<- *message.Message) bool {
	msg, _ := Marshaler{}.Unmarshal(d) // never fails; see Marshaler
	msgCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(msgCtx)

	select {
	case out <- msg:
	case <-ctx.Done():
		_ = d.Nack(false, true)
		return false
	case <-s.closing:
		_ = d.Nack(false, true)
		return false
	}
	// Once handed over, the message is settled by its reader even after ctx
	// ended, so a handler finishing during shutdown still gets its Ack
	// through. An Ack or Nack that fails means the channel is gone: the
	// broker redelivers the message, and the consume loop sees the close.
	select {
	case <-msg.Acked():
		_ = d.Ack(false)
		return true
	case <-msg.Nacked():
		_ = d.Nack(false, true)
		return true
	case <-s.closing:
		_ = d.Nack(false, true)
		return false
	}
}

// Close stops every subscription (a message handed out but not acked is
// redelivered, never acked) and closes the subscriber's connection. It is
// idempotent.
func (s *subscriber) Close() error {
	var conn *amqp.Connection
	s.closeOnce.Do(func() {
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
