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

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/names"
)

// Subscriber returns a Watermill subscriber in spec.Group, built on
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
// A message's context ends, with cause ErrRebalanced, when the consumer
// group session it was delivered in ends (a rebalance: a member joined or
// left). Its ack can no longer commit anything and the partition may
// already be another member's, so a handler should give up and nack it
// (the middleware's waits for a retry or for the breaker do); the message
// is delivered again in the new session. The member rejoins the group once
// every message of its old session has been acked or nacked, which has to
// happen within broker.kafka.rebalance_timeout, else the member is dropped
// from the new generation until it rejoins.
//
// A spec with InFlight above 0 gets a read-ahead subscription instead
// (see subscribeReadAhead): Ordered, unordered, and with retry topics a
// RedeliveryWait. A spec the Broker cannot serve (adapters.CheckSpec) is an
// *adapters.SpecError.
func (b *Broker) Subscriber(spec adapters.SubscriberSpec) (message.Subscriber, error) {
	if err := adapters.CheckSpec(Kind, b.Capabilities(), spec, 0); err != nil {
		return nil, err
	}
	sub, err := b.newSubscriber(spec.Group, spec.InFlight, spec.Ordered)
	if err != nil {
		return nil, err
	}
	sub.wait, sub.deliveries = spec.RedeliveryWait, spec.Deliveries
	return sub, nil
}

// newSubscriber is Subscriber, or with inFlight > 0 a read-ahead
// subscription, ordered when keyed.
func (b *Broker) newSubscriber(consumerGroup string, inFlight int, keyed bool) (*subscriber, error) {
	if err := names.Topic(consumerGroup); err != nil {
		return nil, fmt.Errorf("kafka: consumer group %q: %w", consumerGroup, err)
	}
	if b.closed.Load() {
		return nil, errClosed
	}
	s := &subscriber{b: b, group: consumerGroup, inFlight: inFlight, keyed: keyed, closing: make(chan struct{})}
	b.mu.Lock()
	b.subscribers[s] = struct{}{}
	b.mu.Unlock()
	return s, nil
}

type subscriber struct {
	b     *Broker
	group string
	// inFlight, when above 0, makes it a read-ahead subscription (keyed:
	// one message per aggregate at a time, for an Ordered spec).
	inFlight int
	keyed    bool
	// wait, with inFlight, has it park nacked messages in the retry topic;
	// deliveries then receives each message's delivery number.
	wait       func(delivery int) time.Duration
	deliveries *adapters.Deliveries

	mu        sync.Mutex
	inner     []*wkafka.Subscriber
	closing   chan struct{}
	closeOnce sync.Once
	closeErr  error
	// relays are the running relay goroutines and read-ahead subscriptions;
	// Close waits for them, so every channel has closed when it returns.
	relays sync.WaitGroup
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
	if s.inFlight > 0 {
		return s.subscribeReadAhead(ctx, topic)
	}
	conf, err := consumerConfig(s.b.cfg, s.b.opts)
	if err != nil {
		return nil, err
	}
	joined := make(chan struct{})
	sessions := &claimSessions{byPartition: map[int32]context.Context{}}
	inner, err := wkafka.NewSubscriber(wkafka.SubscriberConfig{
		Brokers:               s.b.cfg.Brokers,
		Unmarshaler:           Marshaler{},
		OverwriteSaramaConfig: conf,
		ConsumerGroup:         s.group,
		NackResendSleep:       s.b.cfg.NackRedeliveryDelay,
		ReconnectRetrySleep:   s.b.cfg.ReconnectDelay,
		Tracer:                joinSignal{joined: joined, once: &sync.Once{}, sessions: sessions},
	}, s.b.logger)
	if err != nil {
		return nil, fmt.Errorf("kafka: cannot create subscriber for group %s: %w", s.group, err)
	}
	if err := s.addRelay(func() { s.inner = append(s.inner, inner) }); err != nil {
		return nil, err
	}

	out, err := inner.Subscribe(ctx, topic)
	if err != nil {
		s.relays.Done()
		_ = inner.Close()
		return nil, fmt.Errorf("kafka: cannot subscribe group %s to topic %s: %w", s.group, topic, err)
	}
	deliver := make(chan *message.Message)
	go s.relay(ctx, out, deliver, sessions)
	s.awaitJoin(ctx, topic, joined)
	return deliver, nil
}

// addRelay counts one more relay goroutine, which Close waits for, and
// runs keep (when not nil) with it, under mu; unless s is closing.
func (s *subscriber) addRelay(keep func()) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.closing:
		return errors.New("kafka: subscriber closed")
	default:
	}
	if keep != nil {
		keep()
	}
	s.relays.Add(1) // under mu with closing open, so before Close waits
	return nil
}

// awaitJoin waits until joined is closed (the consumer has its
// partitions), ctx ends, the subscriber closes or join_wait has passed.
func (s *subscriber) awaitJoin(ctx context.Context, topic string, joined <-chan struct{}) {
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
}

// ErrRebalanced is the cause of a delivered message's context when the
// consumer group session it was delivered in has ended: the message is
// delivered again, and its ack commits nothing.
var ErrRebalanced = errors.New("kafka: the consumer group rebalanced; the message is delivered again")

// relay hands the messages of in to out, each with a context that also ends
// when the session of its partition's claim ends. watermill-kafka derives a
// message's context from the subscription's context only, so a handler
// holding a message (the breaker during an outage) would keep the claim's
// ConsumeClaim, and with it the member, from leaving the ended session:
// the group drops the member after rebalance_timeout and the old session
// keeps failing to commit with a stale generation until the hold ends.
//
// A message whose session has already ended is acked instead of handed out:
// watermill-kafka marks nothing once the session's context has ended (it
// checks before marking), and the ack ends its redelivery of the message
// into the ended session, so the member can rejoin and receive it again.
func (s *subscriber) relay(ctx context.Context, in <-chan *message.Message, out chan<- *message.Message, sessions *claimSessions) {
	defer s.relays.Done()
	defer close(out)
	for msg := range in {
		sess := sessions.of(msg)
		if sess == nil { // not from a group session's claim: as delivered
			sess = context.Background()
		}
		if sess.Err() != nil {
			msg.Ack()
			continue
		}
		mctx, cancel := context.WithCancelCause(msg.Context())
		stop := context.AfterFunc(sess, func() { cancel(ErrRebalanced) })
		context.AfterFunc(mctx, func() { stop() })
		msg.SetContext(mctx)
		select {
		case out <- msg:
		case <-sess.Done():
			msg.Ack() // commits nothing, as above
		case <-ctx.Done(): // watermill-kafka discards it, uncommitted
		case <-s.closing:
		}
	}
}

// claimSessions are the contexts of the consumer group sessions whose claims
// consume the partitions of one subscription, by partition. A message is
// handed out while its claim's ConsumeClaim runs (it waits for the ack), and
// a session starts only after every ConsumeClaim of the previous one has
// returned, so a partition has at most one entry at a time.
type claimSessions struct {
	mu          sync.Mutex
	byPartition map[int32]context.Context
}

func (c *claimSessions) set(partition int32, sess context.Context) {
	c.mu.Lock()
	c.byPartition[partition] = sess
	c.mu.Unlock()
}

func (c *claimSessions) clear(partition int32, sess context.Context) {
	c.mu.Lock()
	if c.byPartition[partition] == sess {
		delete(c.byPartition, partition)
	}
	c.mu.Unlock()
}

// of returns the session context msg was delivered in, or nil.
func (c *claimSessions) of(msg *message.Message) context.Context {
	partition, ok := wkafka.MessagePartitionFromCtx(msg.Context())
	if !ok {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byPartition[partition]
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
		s.relays.Wait()
		s.closeErr = errors.Join(errs...)
		s.b.mu.Lock()
		delete(s.b.subscribers, s)
		s.b.mu.Unlock()
	})
	return s.closeErr
}

// joinSignal is a watermill-kafka tracer that does no tracing: it closes
// joined when the consumer group first hands this consumer its partitions
// and records the session of every claim in sessions, which watermill-kafka
// has no other hooks for.
type joinSignal struct {
	joined   chan struct{}
	once     *sync.Once
	sessions *claimSessions
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

func (h joinHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	h.signal.sessions.set(claim.Partition(), sess.Context())
	defer h.signal.sessions.clear(claim.Partition(), sess.Context())
	return h.ConsumerGroupHandler.ConsumeClaim(sess, claim)
}
