package kafka

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/sleep"
)

const (
	// RetryDeliveryKey is the number of the delivery a parked record is
	// for, in decimal.
	RetryDeliveryKey = "x-millrace-delivery"
	// RetryDueKey is when a parked record is due, in Unix milliseconds, in
	// decimal.
	RetryDueKey = "x-millrace-retry-due"
)

// RetryTopicName is the topic in which consumerGroup parks the failed
// messages of topic for their next attempt (broker.kafka.retry_topics):
// topic + ".retry." + consumerGroup, cut and ended in '-' and 16 hex digits
// of its SHA-256 when longer than a topic name may be.
func RetryTopicName(topic, consumerGroup string) string {
	name := topic + ".retry." + consumerGroup
	if len(name) <= names.MaxTopicLength {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	return name[:names.MaxTopicLength-17] + "-" + hex.EncodeToString(sum[:8])
}

// windowPerInFlight sizes a partition's window, the records read past its
// committed offset, acked or not: 8 times the in-flight count lets a nacked
// record wait out its nack delay at the head of the partition while the
// others go on, at thousands of messages a second, and bounds what a crash
// re-reads.
const windowPerInFlight = 8

// subscribeReadAhead is Subscribe of a subscription whose spec has
// InFlight above 0: a Sarama consumer group of its own, whose claims hand
// out messages through readAheadClaim.
//
// Ordered: a subscription reads ahead of its committed offset and hands
// out up to InFlight messages at once, from one partition as from many,
// one per aggregate (the aggregate-id header; messages without one share a
// key) at a time: it holds the later messages of a busy aggregate until
// the one handed out is acked. So an ordered handler runs many aggregates
// at once from one partition, with more workers than partitions
// (Confluent's Parallel Consumer does the same; watermill-kafka hands out
// one message per partition at a time and cannot).
//
// Acks settle out of order; the committed offset of a partition is the end
// of its contiguous acked prefix, so a crash, a closed subscriber or a
// rebalance re-reads from the oldest message not acked: every message read
// after it comes again (acked ones as duplicates, which the inbox drops),
// in log order, so no message of an aggregate is handled before an earlier
// one. A nacked message keeps its aggregate busy and is handed out again
// after broker.kafka.nack_redelivery_delay; the later messages of its
// aggregate wait, the others go on. The subscription has at most InFlight
// records handed out, ready or waiting to be redelivered, across its
// partitions; a partition reads at most 8 x InFlight past its committed
// offset (its window), held records included, so a slow message or a busy
// aggregate holds up its own partition only once that window is full and
// never the other partitions, and a restart re-reads at most that many per
// partition. A subscription that leaves a session (a rebalance) waits
// until what it handed out is settled (their contexts end with
// ErrRebalanced), so the next owner of a partition never runs a message of
// an aggregate while this one still runs an earlier one.
//
// Unordered: the same without the order: it hands out up to InFlight
// messages at once whatever their aggregates, where the stock subscription
// has one message in flight per partition.
//
// With a RedeliveryWait (broker.kafka.retry_topics): a nacked message is
// parked in the group's retry topic (RetryTopicName), a copy of its record
// (key, value and headers byte for byte) with RetryDeliveryKey set to the
// number of its next delivery and RetryDueKey to when that is, now plus
// RedeliveryWait(n) for the delivery n that was nacked; once the broker
// has the copy the original is acked. Subscribe consumes the topic and its
// retry topic in the group, and hands out a parked record only once it is
// due (a partition of the retry topic waits for its oldest record, so a
// record parked behind one with a longer wait waits as long, at most
// retry.max_interval more than its own wait). Each message's delivery
// number goes to spec.Deliveries: 1 on the topic, the header on the retry
// topic, so the count survives restarts; the headers are not in the
// message's metadata. When the retry topic cannot take a record, the
// message is delivered again in process after nack_redelivery_delay,
// counted. A delivery cut short by a crash or a rebalance is not counted:
// it comes again with its number.
func (s *subscriber) subscribeReadAhead(ctx context.Context, topic string) (<-chan *message.Message, error) {
	topics := []string{topic}
	if s.wait != nil {
		retry := RetryTopicName(topic, s.group)
		if err := s.b.ensureTopic(ctx, retry); err != nil {
			return nil, err
		}
		topics = append(topics, retry)
	}
	conf, err := consumerConfig(s.b.cfg, s.b.opts)
	if err != nil {
		return nil, err
	}
	group, err := sarama.NewConsumerGroup(s.b.cfg.Brokers, s.group, conf)
	if err != nil {
		return nil, fmt.Errorf("kafka: cannot create subscriber for group %s: %w", s.group, err)
	}
	if err := s.addRelay(nil); err != nil {
		_ = group.Close()
		return nil, err
	}

	runCtx, cancel := context.WithCancel(ctx)
	go func() {
		select {
		case <-s.closing:
			cancel()
		case <-runCtx.Done():
		}
	}()
	h := &readAheadHandler{
		s: s, topics: topics, ctx: runCtx, out: make(chan *message.Message),
		slots: make(chan struct{}, s.inFlight), window: windowPerInFlight * s.inFlight,
		joined:     make(chan struct{}),
		commitEach: !conf.Consumer.Offsets.AutoCommit.Enable,
	}
	go func() {
		for err := range group.Errors() {
			s.b.logger.Error("Kafka read-ahead subscription error", err, watermill.LogFields{"consumer_group": s.group, "topic": topic})
		}
	}()
	go h.run(group, cancel)
	s.awaitJoin(ctx, topic, h.joined)
	return h.out, nil
}

// readAheadHandler is the sarama.ConsumerGroupHandler of one subscription
// of a read-ahead subscription (subscribeReadAhead).
type readAheadHandler struct {
	s          *subscriber
	topics     []string        // the topic, and its retry topic with retry topics
	ctx        context.Context // the subscription's: ends at its context's end or Close
	out        chan *message.Message
	slots      chan struct{} // one per record ready, handed out or waiting to be redelivered, across claims
	window     int           // the most records a claim reads past its committed offset
	commitEach bool          // commit after each mark: auto-commit is off

	joined     chan struct{}
	joinedOnce sync.Once
}

// run consumes until the subscription ends, joining every new session.
func (h *readAheadHandler) run(group sarama.ConsumerGroup, cancel context.CancelFunc) {
	defer h.s.relays.Done()
	defer close(h.out)
	defer func() { _ = group.Close() }()
	defer cancel()
	for h.ctx.Err() == nil {
		if err := group.Consume(h.ctx, h.topics, h); err != nil && h.ctx.Err() == nil {
			h.s.b.logger.Error("Kafka read-ahead subscription interrupted, resuming", err, watermill.LogFields{
				"consumer_group": h.s.group, "topic": h.topics[0], "retry_in": h.s.b.cfg.ReconnectDelay.String(),
			})
			if !sleep.For(h.ctx, h.s.b.cfg.ReconnectDelay) {
				return
			}
		}
	}
}

// Setup signals the first join.
func (h *readAheadHandler) Setup(sarama.ConsumerGroupSession) error {
	h.joinedOnce.Do(func() { close(h.joined) })
	return nil
}

// Cleanup has nothing to do: every claim settled what it handed out.
func (h *readAheadHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim hands out the claim's messages until its session ends.
func (h *readAheadHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	c := &readAheadClaim{
		h: h, sess: sess, claim: claim, held: map[string][]*pendingRecord{},
		parked:    len(h.topics) > 1 && claim.Topic() == h.topics[1],
		settled:   make(chan settlement),
		redeliver: make(chan *pendingRecord),
		stopped:   make(chan struct{}),
	}
	c.loop()
	return nil
}

// pendingRecord is a record read from a claim and not yet committed.
type pendingRecord struct {
	rec   *sarama.ConsumerMessage
	key   string // its aggregate id, when keyed
	acked bool
	held  bool // waiting for the record of its aggregate before it
	// delivery is the number of its next delivery and due when that may
	// be, with retry topics.
	delivery int
	due      time.Time
	// msg is the delivery handed out or ready to be; ctx is the context
	// prepare gave it (a handler may give msg another) and cancel ends it.
	msg    *message.Message
	ctx    context.Context
	cancel func()
}

type settlement struct {
	p     *pendingRecord
	acked bool
}

// readAheadClaim is the state of one partition of a read-ahead subscription in
// one session; loop owns it.
type readAheadClaim struct {
	h     *readAheadHandler
	sess  sarama.ConsumerGroupSession
	claim sarama.ConsumerGroupClaim

	window []*pendingRecord // read and not committed, in offset order; those neither acked nor held hold a slot
	// held has a key for each aggregate with a record handed out, ready or
	// waiting to be redelivered, and the later records of that aggregate,
	// held, in offset order.
	held  map[string][]*pendingRecord
	ready []*pendingRecord // to hand out, in order
	out   int              // handed out and not settled
	stash *pendingRecord   // read, ready once it has a slot (and is due)
	// parked is true for a claim of a retry topic; wake fires when its
	// stash is due.
	parked bool
	wake   *time.Timer

	settled   chan settlement
	redeliver chan *pendingRecord
	stopped   chan struct{} // closed when loop stops taking settlements
}

// loop reads, hands out and settles until the session or the subscription
// ends, then waits for what it handed out and gives back its slots.
func (c *readAheadClaim) loop() {
	defer c.release()
	done := c.sess.Context().Done()
	for {
		var in <-chan *sarama.ConsumerMessage
		var slot chan<- struct{}
		var due <-chan time.Time
		switch {
		case c.wake != nil:
			due = c.wake.C
		case c.stash != nil:
			slot = c.h.slots
		case len(c.window) < c.h.window:
			in = c.claim.Messages()
		}
		var send chan<- *message.Message
		var next *message.Message
		if len(c.ready) > 0 {
			send, next = c.h.out, c.ready[0].msg
			c.prepare(c.ready[0])
		}
		select {
		case rec, ok := <-in:
			if !ok {
				c.drain()
				return
			}
			c.read(rec)
		case <-due:
			c.wake = nil
		case slot <- struct{}{}:
			c.window = append(c.window, c.stash)
			c.ready = append(c.ready, c.stash)
			c.stash = nil
		case send <- next:
			p := c.ready[0]
			c.ready = c.ready[1:]
			c.out++
			go c.watch(p, next, p.cancel)
		case st := <-c.settled:
			c.settle(st)
		case p := <-c.redeliver:
			c.ready = append(c.ready, p)
		case <-done:
			c.drain()
			return
		case <-c.h.ctx.Done():
			c.drain()
			return
		}
	}
}

// read adds rec to the window at once, held, when its aggregate is busy;
// else it waits in the stash for a slot, and nothing more is read until it
// has one, so the window stays in offset order. Held records take no slot:
// a busy aggregate's backlog fills only its own partition's window, never
// the slots the other partitions need.
func (c *readAheadClaim) read(rec *sarama.ConsumerMessage) {
	p := &pendingRecord{rec: rec, delivery: 1}
	c.unmarshal(p)
	if c.parked {
		if wait := time.Until(p.due); wait > 0 {
			c.wake = time.NewTimer(wait)
		}
	}
	if c.h.s.keyed {
		p.key = p.msg.Metadata.Get(envelope.AggregateIDKey)
		if queue, busy := c.held[p.key]; busy {
			p.held = true
			c.held[p.key] = append(queue, p)
			c.window = append(c.window, p)
			return
		}
		c.held[p.key] = nil
	}
	c.stash = p
}

// unmarshal sets p's message from its record; a parked record's delivery
// and due time come from its headers, which the message does not carry.
func (c *readAheadClaim) unmarshal(p *pendingRecord) {
	p.msg, _ = Marshaler{}.Unmarshal(p.rec) // never fails: it only copies
	if !c.parked {
		return
	}
	if n, err := strconv.Atoi(p.msg.Metadata.Get(RetryDeliveryKey)); err == nil && n > p.delivery {
		p.delivery = n
	}
	if ms, err := strconv.ParseInt(p.msg.Metadata.Get(RetryDueKey), 10, 64); err == nil {
		p.due = time.UnixMilli(ms)
	}
	delete(p.msg.Metadata, RetryDeliveryKey)
	delete(p.msg.Metadata, RetryDueKey)
}

// prepare gives p's delivery, once, a context that ends when it is
// settled, with the subscription, or, with cause ErrRebalanced, with the
// session.
func (c *readAheadClaim) prepare(p *pendingRecord) {
	if p.cancel != nil {
		return
	}
	ctx, cancel := context.WithCancelCause(c.h.ctx)
	stop := context.AfterFunc(c.sess.Context(), func() { cancel(ErrRebalanced) })
	p.ctx = ctx
	p.msg.SetContext(ctx)
	forget := func() {}
	if c.h.s.wait != nil {
		forget = c.h.s.deliveries.Record(p.msg, p.delivery)
	}
	p.cancel = func() {
		stop()
		cancel(context.Canceled)
		forget()
	}
}

// watch reports msg's ack or nack to the loop, then ends its context. With
// retry topics a nacked message is parked, and reported as acked once the
// broker has it.
func (c *readAheadClaim) watch(p *pendingRecord, msg *message.Message, cancel func()) {
	var acked bool
	select {
	case <-msg.Acked():
		acked = true
	case <-msg.Nacked():
		// A nack at the end of the session or subscription is no failed
		// attempt: the record is read again, uncounted.
		acked = c.h.s.wait != nil && p.ctx.Err() == nil && c.park(p)
	}
	cancel()
	select {
	case c.settled <- settlement{p: p, acked: acked}:
	case <-c.stopped:
	}
}

// park copies p's record, nacked at delivery p.delivery, into the retry
// topic for its next delivery, and reports whether the broker has it.
func (c *readAheadClaim) park(p *pendingRecord) bool {
	due := time.Now().Add(c.h.s.wait(p.delivery))
	rec := &kgo.Record{Topic: c.h.topics[1], Key: p.rec.Key, Value: p.rec.Value}
	for _, h := range p.rec.Headers {
		if k := string(h.Key); k != RetryDeliveryKey && k != RetryDueKey {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: h.Value})
		}
	}
	rec.Headers = append(rec.Headers,
		kgo.RecordHeader{Key: RetryDeliveryKey, Value: strconv.AppendInt(nil, int64(p.delivery+1), 10)},
		kgo.RecordHeader{Key: RetryDueKey, Value: strconv.AppendInt(nil, due.UnixMilli(), 10)})
	errs := []error{nil}
	c.h.s.b.send(c.h.ctx, []*kgo.Record{rec}, errs)
	if errs[0] != nil {
		c.h.s.b.logger.Error("Kafka retry topic did not take a failed message; delivering it again in process", errs[0], watermill.LogFields{
			"consumer_group": c.h.s.group, "retry_topic": rec.Topic, "message_uuid": p.msg.UUID,
			"delivery": p.delivery, "nack_redelivery_delay": c.h.s.b.cfg.NackRedeliveryDelay.String(),
		})
		return false
	}
	return true
}

// settle records an ack or a nack. An ack frees the aggregate for its next
// record and moves the committed offset over the acked prefix; a nacked
// record is handed out again after nack_redelivery_delay, its aggregate
// busy until then.
func (c *readAheadClaim) settle(st settlement) {
	c.out--
	p := st.p
	if !st.acked {
		p.delivery++
		time.AfterFunc(c.h.s.b.cfg.NackRedeliveryDelay, func() {
			c.unmarshal(p)
			p.cancel = nil
			select {
			case c.redeliver <- p:
			case <-c.stopped: // the claim has ended; the record is read again
			}
		})
		return
	}
	p.acked, p.msg, p.ctx, p.cancel = true, nil, nil, nil
	if !c.h.s.keyed || !c.next(p.key) {
		<-c.h.slots
	}
	c.commit()
}

// next makes the oldest held record of key ready, with the slot of the
// record of key just acked, and reports whether there was one; else key is
// no longer busy.
func (c *readAheadClaim) next(key string) bool {
	queue := c.held[key]
	if len(queue) == 0 {
		delete(c.held, key)
		return false
	}
	q := queue[0]
	c.held[key] = queue[1:]
	q.held = false
	c.ready = append(c.ready, q)
	return true
}

// commit moves the committed offset over the acked prefix of the window,
// while the session lasts.
func (c *readAheadClaim) commit() {
	committed := 0
	for committed < len(c.window) && c.window[committed].acked {
		committed++
	}
	if committed == 0 || c.sess.Context().Err() != nil {
		return
	}
	c.sess.MarkOffset(c.claim.Topic(), c.claim.Partition(), c.window[committed-1].rec.Offset+1, "")
	if c.h.commitEach {
		c.sess.Commit()
	}
	c.window = c.window[committed:]
}

// drain stops handing out and, while the subscription lasts, waits until
// every message handed out is settled (their contexts have ended), so no
// later message of their aggregates can be handed out by the partition's
// next owner while they run. What is acked in the meantime still moves the
// committed offset while the session lasts. When the subscription ends it
// does not wait: the Dispatcher settles the messages it holds only after
// Close returns, and what it ran it has already drained.
func (c *readAheadClaim) drain() {
	if len(c.ready) > 0 && c.ready[0].cancel != nil {
		c.ready[0].cancel() // prepared, never handed out
	}
	c.ready = nil
	for c.out > 0 {
		select {
		case st := <-c.settled:
			if st.acked {
				c.settle(st)
			} else {
				c.out--
			}
		case <-c.h.ctx.Done():
			return
		}
	}
}

// release gives back the slots of the records neither acked nor held and
// stops the watchers and redelivery timers still waiting to report.
func (c *readAheadClaim) release() {
	close(c.stopped)
	if c.wake != nil {
		c.wake.Stop()
	}
	for _, p := range c.window {
		if !p.acked && !p.held {
			<-c.h.slots
		}
	}
}
