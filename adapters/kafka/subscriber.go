package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/internal/names"
)

// Subscriber returns a Watermill subscriber in consumerGroup, built on
// watermill-kafka. Every group gets every message of a topic; the
// subscribers of one group share its partitions, so each message goes to
// one of them.
//
// Delivery is per partition: watermill-kafka hands out one message of a
// partition at a time and the next only after Ack, so events of one
// aggregate (one key, one partition) are processed in order; partitions are
// processed concurrently. Ack marks the offset and it is committed every
// broker.kafka.commit_interval; Nack delivers the message again after
// broker.kafka.nack_redelivery_delay; nothing unacked is ever committed, so
// a crash or a closed subscriber means redelivery. A rebalance redelivers
// the messages that were in flight (at-least-once).
//
// Subscribe returns once the consumer has joined its group and received its
// partitions, or after broker.kafka.join_wait, so consumers started together
// settle before messages flow.
//
// As in watermill-kafka, a rebalance waits until every message already handed
// to a subscription's channel has been taken and acked or nacked (at most
// broker.kafka.rebalance_timeout, after which the member is dropped and the
// message redelivered elsewhere): keep reading the channel.
func (b *Broker) Subscriber(consumerGroup string) (message.Subscriber, error) {
	if err := names.Topic(consumerGroup); err != nil {
		return nil, fmt.Errorf("kafka: consumer group %q: %w", consumerGroup, err)
	}
	if b.closed.Load() {
		return nil, errClosed
	}
	s := &subscriber{b: b, group: consumerGroup, closing: make(chan struct{})}
	b.mu.Lock()
	b.subscribers[s] = struct{}{}
	b.mu.Unlock()
	return s, nil
}

type subscriber struct {
	b     *Broker
	group string

	mu        sync.Mutex
	inner     []*wkafka.Subscriber
	closing   chan struct{}
	closeOnce sync.Once
	closeErr  error
}

var (
	_ message.Subscriber           = (*subscriber)(nil)
	_ message.SubscribeInitializer = (*subscriber)(nil)
)

// Subscribe consumes topic in the subscriber's group until ctx ends or the
// subscriber closes; then the channel closes.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.b.ensureTopic(ctx, topic); err != nil {
		return nil, err
	}
	conf, err := consumerConfig(s.b.cfg, s.b.opts)
	if err != nil {
		return nil, err
	}
	joined := make(chan struct{})
	inner, err := wkafka.NewSubscriber(wkafka.SubscriberConfig{
		Brokers:               s.b.cfg.Brokers,
		Unmarshaler:           Marshaler{},
		OverwriteSaramaConfig: conf,
		ConsumerGroup:         s.group,
		NackResendSleep:       s.b.cfg.NackRedeliveryDelay,
		ReconnectRetrySleep:   s.b.cfg.ReconnectDelay,
		Tracer:                joinSignal{joined: joined, once: &sync.Once{}},
	}, s.b.logger)
	if err != nil {
		return nil, fmt.Errorf("kafka: cannot create subscriber for group %s: %w", s.group, err)
	}
	s.mu.Lock()
	select {
	case <-s.closing:
		s.mu.Unlock()
		return nil, errors.New("kafka: subscriber closed")
	default:
	}
	s.inner = append(s.inner, inner)
	s.mu.Unlock()

	out, err := inner.Subscribe(ctx, topic)
	if err != nil {
		_ = inner.Close()
		return nil, fmt.Errorf("kafka: cannot subscribe group %s to topic %s: %w", s.group, topic, err)
	}
	wait := time.NewTimer(s.b.cfg.JoinWait)
	defer wait.Stop()
	select {
	case <-joined:
	case <-ctx.Done(): // the channel closes as the context has ended
	case <-s.closing: // the channel closes as the subscriber closes
	case <-wait.C:
		// Typically another member of the group holds a delivered message
		// nobody has taken yet, which holds up the rebalance until it is.
		s.b.logger.Info("Kafka consumer group has not settled yet; consuming once it has", watermill.LogFields{
			"consumer_group": s.group, "topic": topic, "join_wait": s.b.cfg.JoinWait.String(),
		})
	}
	return out, nil
}

// SubscribeInitialize provisions topic for the subscriber's group (Watermill
// calls it before Subscribe when present).
func (s *subscriber) SubscribeInitialize(topic string) error {
	return s.b.Provision(context.Background(), topic, s.group)
}

// Close stops every subscription of this subscriber, without committing
// anything that was not acked, and waits for them. It is idempotent.
func (s *subscriber) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		close(s.closing)
		inner := s.inner
		s.mu.Unlock()
		var errs []error
		for _, in := range inner {
			errs = append(errs, in.Close())
		}
		s.closeErr = errors.Join(errs...)
		s.b.mu.Lock()
		delete(s.b.subscribers, s)
		s.b.mu.Unlock()
	})
	return s.closeErr
}

// joinSignal is a watermill-kafka tracer that does no tracing: it closes
// joined when the consumer group first hands this consumer its partitions,
// which watermill-kafka has no other hook for.
type joinSignal struct {
	joined chan struct{}
	once   *sync.Once
}

func (j joinSignal) WrapConsumer(c sarama.Consumer) sarama.Consumer { return c }

func (j joinSignal) WrapPartitionConsumer(pc sarama.PartitionConsumer) sarama.PartitionConsumer {
	return pc
}

func (j joinSignal) WrapSyncProducer(_ *sarama.Config, p sarama.SyncProducer) sarama.SyncProducer {
	return p
}

func (j joinSignal) WrapConsumerGroupHandler(h sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler {
	return joinHandler{ConsumerGroupHandler: h, signal: j}
}

type joinHandler struct {
	sarama.ConsumerGroupHandler
	signal joinSignal
}

func (h joinHandler) Setup(sess sarama.ConsumerGroupSession) error {
	err := h.ConsumerGroupHandler.Setup(sess)
	h.signal.once.Do(func() { close(h.signal.joined) })
	return err
}
