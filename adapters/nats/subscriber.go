package nats

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
)

// subscriberCloseTimeout bounds how long Close waits for in-flight messages
// to be handed back; they are never acked by closing.
const subscriberCloseTimeout = 30 * time.Second

// subscriber is the message.Subscriber of one consumer group: a
// watermill-nats JetStream subscriber on a connection of its own, bound to
// the group's durable consumer on each topic's stream.
type subscriber struct {
	b      *Broker
	group  string
	nc     *nats.Conn
	wm     *wmnats.Subscriber
	closed chan struct{} // closed when nc has closed

	once     sync.Once
	closeErr error
}

var (
	_ message.Subscriber           = (*subscriber)(nil)
	_ message.SubscribeInitializer = (*subscriber)(nil)
)

// Subscriber returns a subscriber for consumerGroup on a connection of its
// own. Every group gets every message of a topic; the subscriptions of one
// group (broker.nats.consumer.subscribers per Subscribe call, in this or any
// other process) compete. A message is acked only by msg.Ack (the server
// confirms the ack); Nack makes the server deliver it again after
// consumer.nak_delay; a message neither acked nor nacked (handler too slow,
// subscriber closed, process gone) is delivered again after
// consumer.ack_wait. Subscribe creates the topic's stream and the group's
// consumer when they are missing.
func (b *Broker) Subscriber(consumerGroup string) (message.Subscriber, error) {
	if err := checkGroup(consumerGroup); err != nil {
		return nil, fmt.Errorf("nats: %w", err)
	}
	if b.isClosed() {
		return nil, errBrokerClosed
	}
	closed := make(chan struct{})
	nc, err := b.connect(context.Background(), "millrace-subscriber-"+consumerGroup,
		nats.ClosedHandler(func(*nats.Conn) { close(closed) }))
	if err != nil {
		return nil, err
	}
	cc := b.cfg.Consumer
	durable := ConsumerName(consumerGroup)
	wm, err := wmnats.NewSubscriberWithNatsConn(nc, wmnats.SubscriberSubscriptionConfig{
		Unmarshaler:      marshaler{},
		SubscribersCount: cc.Subscribers,
		AckWaitTimeout:   cc.AckWait,
		CloseTimeout:     subscriberCloseTimeout,
		SubscribeTimeout: b.opts.ConnectTimeout,
		// The subject is the topic; the queue group is the consumer's deliver group.
		SubjectCalculator: func(queueGroup, topic string) *wmnats.SubjectDetail {
			return &wmnats.SubjectDetail{Primary: topic, QueueGroup: queueGroup}
		},
		QueueGroupPrefix: durable,
		// A nacked message comes back after a pause instead of at once.
		NakDelay: wmnats.NewStaticDelay(cc.NakDelay),
		JetStream: wmnats.JetStreamConfig{
			SubscribeOptions: []nats.SubOpt{
				// Without ManualAck nats.go acks every message when
				// watermill-nats's callback returns, which it also does on its
				// own ack timeout, on close and on an unmarshal error: a lost message.
				nats.ManualAck(),
				nats.AckExplicit(),
				nats.DeliverAll(),
			},
			// DurablePrefix alone would give every topic the same durable;
			// the calculator names the group's consumer on the subject's own
			// stream (one stream per topic), the one Provision created.
			DurablePrefix: durable,
			DurableCalculator: func(durable, _ string) string {
				return durable
			},
			AckAsync:   false, // AckSync: an ack counts once the server confirmed it
			TrackMsgId: true,
		},
	}, b.logger)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("nats: %w", err)
	}
	s := &subscriber{b: b, group: consumerGroup, nc: nc, wm: wm, closed: closed}
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		_ = s.Close()
		return nil, errBrokerClosed
	}
	b.subscribers = append(b.subscribers, s)
	b.mu.Unlock()
	return s, nil
}

// Subscribe provisions topic's stream and the group's consumer if needed and
// returns the group's messages of topic. The channel closes when ctx is done
// or the subscriber is closed.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.SubscribeInitialize(topic); err != nil {
		return nil, err
	}
	return s.wm.Subscribe(ctx, topic)
}

// SubscribeInitialize provisions topic's stream and the group's consumer.
func (s *subscriber) SubscribeInitialize(topic string) error {
	ctx, cancel := context.WithTimeout(context.Background(), s.b.opts.ConnectTimeout)
	defer cancel()
	return s.b.Provision(ctx, topic, s.group)
}

// Close stops the subscriptions without acking anything still unacked and
// closes the connection. It is idempotent.
func (s *subscriber) Close() error {
	s.once.Do(func() {
		err := s.wm.Close()
		if err != nil {
			s.nc.Close()
		}
		select {
		case <-s.closed:
		case <-time.After(subscriberCloseTimeout):
			s.nc.Close()
		}
		// A connection that is down or closed has nothing to drain.
		if err != nil && !errors.Is(err, nats.ErrConnectionClosed) && !errors.Is(err, nats.ErrConnectionReconnecting) {
			s.closeErr = fmt.Errorf("nats: closing subscriber of group %q: %w", s.group, err)
		}
		s.b.mu.Lock()
		s.b.subscribers = slices.DeleteFunc(s.b.subscribers, func(o *subscriber) bool { return o == s })
		s.b.mu.Unlock()
	})
	return s.closeErr
}
