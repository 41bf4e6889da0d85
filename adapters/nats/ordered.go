package nats

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
)

// orderedMaxAckPending is the max_ack_pending of an ordered group's
// consumer as Provision creates it: a stock Subscriber on it then keeps
// stream order, one message at a time. The group's ordered subscriber
// recreates the consumer with its own in-flight count (subscribeOrdered).
const orderedMaxAckPending = 1

// markOrdered remembers consumerGroups of topic as ordered groups.
func (b *Broker) markOrdered(topic string, consumerGroups ...string) error {
	if err := checkTopic(topic); err != nil {
		return adapters.Permanent(err)
	}
	for _, g := range consumerGroups {
		if err := checkGroup(g); err != nil {
			return adapters.Permanent(err)
		}
	}
	b.mu.Lock()
	for _, g := range consumerGroups {
		key := topic + "\x00" + g
		if !b.ordered[key] {
			b.ordered[key] = true
			delete(b.consumers, key) // known to match the unordered settings only
		}
	}
	b.mu.Unlock()
	return nil
}

// isOrdered reports whether group's consumer on topic was provisioned as an
// ordered group's (ProvisionGroup with GroupSpec.Ordered).
func (b *Broker) isOrdered(topic, group string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.ordered[topic+"\x00"+group]
}

// maxAckPending is the max_ack_pending group's consumer on topic is made with.
func (b *Broker) maxAckPending(topic, group string) int {
	if b.isOrdered(topic, group) {
		return orderedMaxAckPending
	}
	return b.cfg.Consumer.MaxAckPending
}

// subscribeOrdered is Subscriber for an Ordered spec
// (adapters.Capabilities.OrderedFlight). One subscription at a time, in this or any
// process, consumes the group: it holds the group's lease (a key of the
// millrace_leases key-value bucket, renewed every consumer.lease_ttl/4) and
// the others wait for it. On taking the lease it recreates the group's
// consumer with max_ack_pending spec.InFlight, a deliver subject of its own, and
// its start at the first message not yet acked (the consumer's ack floor),
// so everything the last holder did not ack comes again in stream order
// before anything newer; messages it did ack past the floor come again too,
// as duplicates (the inbox drops them). It hands messages out without
// waiting for the previous one's ack, at most one per aggregate (the
// aggregate-id header) at a time, holding the later ones of a busy
// aggregate; each Ack is an ack of its own message. A nacked message is
// handed out again after consumer.nak_delay, its aggregate's later
// messages held meanwhile, with nothing sent to the server (the other
// aggregates go on). A delivery it missed (a gap in the consumer's
// sequence, as after a lost connection) stops the hand-out until what was
// handed out is settled, then it recreates the consumer the same way.
// Closing, ending the Subscribe context or losing the lease stops the same
// way and gives the lease up (a stop) or leaves it to expire (lost:
// another holder has it or will after lease_ttl).
//
// The deliveries counted by the server start again at 1 with each
// recreation, so consumer.max_deliver does not bound an ordered group's
// deliveries; millrace's poison queue does.
func (b *Broker) subscribeOrdered(spec adapters.SubscriberSpec) (message.Subscriber, error) {
	return started(b, &orderedSubscriber{group: spec.Group, inFlight: spec.InFlight})
}

// orderedSubscriber is subscribeOrdered's message.Subscriber. Close
// stops every subscription and waits until each has given its lease up.
type orderedSubscriber struct {
	lifecycle
	group    string
	inFlight int
	subs     []*orderedSubscription // guarded by mu
}

var _ message.SubscribeInitializer = (*orderedSubscriber)(nil)

// SubscribeInitialize provisions topic's stream and the group's consumer,
// as an ordered group's.
func (s *orderedSubscriber) SubscribeInitialize(topic string) error {
	return s.b.withinConnectTimeout(func(ctx context.Context) error {
		return s.b.ProvisionGroup(ctx, topic, adapters.GroupSpec{Name: s.group, Start: adapters.StartAll, Ordered: true})
	})
}

// Subscribe provisions topic's stream and the group's consumer and returns
// the group's messages of topic once this subscription holds the group's
// lease. The channel closes when ctx ends or the subscriber closes.
func (s *orderedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.lockOpen(s.SubscribeInitialize, topic); err != nil {
		return nil, err
	}
	defer s.mu.Unlock()
	stream := StreamName(topic)
	sub := &orderedSubscription{
		s:       s,
		topic:   topic,
		stream:  stream,
		durable: ConsumerName(s.group),
		owner:   watermill.NewShortUUID(),
		acked:   map[uint64]bool{},
		out:     make(chan *message.Message),
		logger:  s.b.logger.With(watermill.LogFields{"consumer_group": s.group, "topic": topic}),
	}
	runCtx, cancel := context.WithCancel(ctx)
	s.subs = append(s.subs, sub)
	s.running.Go(func() {
		defer cancel()
		sub.run(runCtx)
		s.mu.Lock()
		s.subs = slices.DeleteFunc(s.subs, func(o *orderedSubscription) bool { return o == sub })
		s.mu.Unlock()
	})
	go func() {
		select {
		case <-runCtx.Done():
		case <-s.closing:
			cancel()
		}
	}()
	return sub.out, nil
}

// orderedSubscription is one Subscribe call of an orderedSubscriber.
type orderedSubscription struct {
	s                      *orderedSubscriber
	topic, stream, durable string
	owner                  string // this subscription in the lease
	out                    chan *message.Message
	logger                 watermill.LoggerAdapter

	mu sync.Mutex
	nc *nats.Conn // the connection it consumes on while it holds the lease

	// acked holds the stream sequences past the consumer's ack floor whose
	// acks the server confirmed: when a recreated consumer delivers them
	// again they are acked at once instead of handed out as duplicates. It
	// is cut to the new floor at each recreation, and holds at most
	// maxAckedMemory (past that, duplicates go to the reader).
	acked map[uint64]bool
}

// maxAckedMemory bounds orderedSubscription.acked.
const maxAckedMemory = 1 << 16

// conn is the connection the subscription consumes on, nil while it waits
// for the lease.
func (o *orderedSubscription) conn() *nats.Conn {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.nc
}

// run takes the group's lease, consumes while it holds it, and starts over
// when it loses it, until ctx ends.
func (o *orderedSubscription) run(ctx context.Context) {
	defer close(o.out)
	b := o.s.b
	for ctx.Err() == nil {
		l, err := b.acquireLease(ctx, leaseKey(o.topic, o.s.group), o.owner, b.cfg.Consumer.LeaseTTL)
		if err != nil {
			return
		}
		o.logger.Info("Consuming an ordered group: this subscription holds its lease", nil)
		o.own(ctx, l)
		l.release()
		select { // lets another process take it first
		case <-ctx.Done():
		case <-time.After(b.cfg.Consumer.LeaseTTL / 4):
		}
	}
}

// errRecreate ends a consumption whose consumer must be recreated from its
// ack floor: a delivery was missed.
var errRecreate = errors.New("nats: ordered consumer to be recreated from its ack floor")

// own consumes the group while it holds l, recreating the consumer after
// each missed delivery, until ctx ends or l is lost.
func (o *orderedSubscription) own(ctx context.Context, l *lease) {
	b := o.s.b
	ncClosed := make(chan struct{})
	nc, err := b.connect(ctx, "millrace-ordered-subscriber-"+o.s.group,
		nats.ClosedHandler(func(*nats.Conn) { close(ncClosed) }))
	if err != nil {
		o.logger.Error("Cannot connect for an ordered group; giving its lease up", err, nil)
		return
	}
	o.mu.Lock()
	o.nc = nc
	o.mu.Unlock()
	defer func() {
		o.mu.Lock()
		o.nc = nil
		o.mu.Unlock()
		nc.Close()
	}()
	pause := time.Duration(0)
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.lost:
			o.logger.Info("Lost an ordered group's lease; waiting to take it again", nil)
			return
		case <-time.After(pause):
		}
		msgs := make(chan *nats.Msg, o.s.inFlight+64)
		sub, err := o.recreate(ctx, nc, l, msgs)
		if err != nil {
			if ctx.Err() == nil {
				o.logger.Error("Cannot recreate an ordered group's consumer; trying again", err, nil)
			}
			pause = b.cfg.Consumer.LeaseTTL / 4
			continue
		}
		err = o.consume(ctx, l, msgs, ncClosed)
		_ = sub.Unsubscribe()
		if !errors.Is(err, errRecreate) {
			return
		}
		pause = 0
	}
}

// recreate records the consumer's ack floor in l, deletes the consumer and
// makes it again from the message after the floor, delivering to a
// subject of its own that sub, subscribed first, passes to msgs.
func (o *orderedSubscription) recreate(ctx context.Context, nc *nats.Conn, l *lease, msgs chan *nats.Msg) (*nats.Subscription, error) {
	b := o.s.b
	ctx, cancel := context.WithTimeout(ctx, b.opts.ConnectTimeout)
	defer cancel()
	stream, err := b.js.Stream(ctx, o.stream)
	if err != nil {
		return nil, fmt.Errorf("reading stream %q: %w", o.stream, err)
	}
	created := stream.CachedInfo().Created
	// The lease's floor counts when the consumer is gone or was made again
	// by another process's Provision meanwhile; a stream made again resets it.
	floor := l.floorIn(created)
	c, err := b.js.PushConsumer(ctx, o.stream, o.durable)
	switch {
	case err == nil:
		info, err := c.Info(ctx)
		if err != nil {
			return nil, fmt.Errorf("reading consumer %q of stream %q: %w", o.durable, o.stream, err)
		}
		floor = max(floor, info.AckFloor.Stream)
		if info.Config.DeliverPolicy == jetstream.DeliverByStartSequencePolicy {
			// Nothing before where the consumer was made to start: a
			// group that started new (ProvisionGroup), or this
			// subscriber's last recreation.
			floor = max(floor, info.Config.OptStartSeq-1)
		}
	case !errors.Is(err, jetstream.ErrConsumerNotFound):
		return nil, fmt.Errorf("reading consumer %q of stream %q: %w", o.durable, o.stream, err)
	}
	if err := l.setFloor(ctx, floor, created); err != nil {
		return nil, fmt.Errorf("recording the ack floor %d in the lease: %w", floor, err)
	}
	for seq := range o.acked {
		if seq <= floor {
			delete(o.acked, seq)
		}
	}
	want := b.consumerConfig(o.topic, o.s.group)
	want.MaxAckPending = o.s.inFlight
	want.DeliverSubject = want.DeliverSubject + "." + watermill.NewShortUUID()
	if floor > 0 {
		want.DeliverPolicy, want.OptStartSeq = jetstream.DeliverByStartSequencePolicy, floor+1
	}
	sub, err := nc.ChanQueueSubscribe(want.DeliverSubject, want.DeliverGroup, msgs)
	if err == nil {
		err = nc.FlushWithContext(ctx) // the server knows the interest before the consumer pushes
	}
	if err != nil {
		return nil, fmt.Errorf("subscribing to %q: %w", want.DeliverSubject, err)
	}
	if err := b.js.DeleteConsumer(ctx, o.stream, o.durable); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("deleting consumer %q of stream %q: %w", o.durable, o.stream, err)
	}
	if _, err := b.js.CreatePushConsumer(ctx, o.stream, want); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("creating consumer %q of stream %q from stream sequence %d: %w", o.durable, o.stream, floor+1, err)
	}
	return sub, nil
}

// heldMsg is a delivery the subscription holds until its reader settles it.
type heldMsg struct {
	seq   uint64                   // stream sequence
	key   string                   // aggregate id
	reply atomic.Pointer[nats.Msg] // its latest delivery: the one to ack
	msg   *message.Message
	touch time.Time // when the server last heard of it
}

// settlement is a handed-out message's outcome.
type settlement struct {
	h         *heldMsg
	acked     bool
	confirmed bool // the server confirmed the ack
}

// consume hands the deliveries on msgs out in stream order, at most one per
// aggregate at a time, and settles each as its reader decides. It returns
// errRecreate (a missed delivery), or nil when ctx ended, l was
// lost or the connection closed, always after what it handed out was
// settled.
func (o *orderedSubscription) consume(ctx context.Context, l *lease, msgs <-chan *nats.Msg, ncClosed <-chan struct{}) error {
	ackWait := o.s.b.cfg.Consumer.AckWait
	q := newOrderedQueue(ctx, o)
	defer q.cancelAll()
	// Held messages must not reach ack_wait: the server would deliver them
	// again and count it.
	progress := time.NewTicker(max(ackWait/3, time.Millisecond))
	defer progress.Stop()
	var (
		stopErr  error
		stopping bool
		lost     = l.lost
		done     = ctx.Done()
	)
	for {
		if !stopping && !l.fresh() {
			stopping = true // paused or cut off past ttl/2: maybe taken over
		}
		var send chan<- *message.Message
		var next *message.Message
		var recv <-chan *nats.Msg
		var retry <-chan *heldMsg
		if !stopping {
			if len(q.ready) > 0 {
				send, next = o.out, q.ready[0].msg
			}
			recv, retry = msgs, q.again
		}
		select {
		case nm := <-recv:
			if err := q.accept(nm); err != nil {
				stopping, stopErr = true, err
			}
		case h := <-retry:
			q.requeue(h)
		case send <- next:
			q.handOut()
		case st := <-q.settled:
			q.settle(st, stopping)
		case <-progress.C:
			q.keepInProgress(ackWait / 3)
		case <-lost:
			stopping, lost = true, nil
		case <-done:
			stopping, done = true, nil
		case <-ncClosed:
			stopping, ncClosed = true, nil
		}
		if stopping && q.unsettled == 0 {
			return stopErr
		}
	}
}

// orderedQueue is what consume holds: the deliveries it has accepted, in
// stream order, and which aggregate each waits behind.
type orderedQueue struct {
	o         *orderedSubscription
	ctx       context.Context
	ready     []*heldMsg            // to hand out, in stream order
	waiting   map[string][]*heldMsg // per busy aggregate, behind the one handed out
	bySeq     map[uint64]*heldMsg   // every message held, handed out or not
	cancels   map[*heldMsg]context.CancelFunc
	unsettled int
	nextSeq   uint64 // the consumer sequence expected next
	settled   chan settlement
	// Nacked messages waiting for nak_delay: never more than handed out, so
	// a timer firing after consume returned never blocks.
	again chan *heldMsg
}

func newOrderedQueue(ctx context.Context, o *orderedSubscription) *orderedQueue {
	return &orderedQueue{
		o:       o,
		ctx:     ctx,
		waiting: map[string][]*heldMsg{},
		bySeq:   map[uint64]*heldMsg{},
		cancels: map[*heldMsg]context.CancelFunc{},
		nextSeq: 1,
		settled: make(chan settlement, o.s.inFlight), // never more handed out unsettled
		again:   make(chan *heldMsg, o.s.inFlight),
	}
}

// cancelAll cancels the contexts of the messages still held.
func (q *orderedQueue) cancelAll() {
	for _, cancel := range q.cancels {
		cancel()
	}
}

// accept takes a delivery in: it queues a new message behind its aggregate,
// refreshes the reply of one held already, and acks again one acked before.
// It returns errRecreate when a delivery was missed.
func (q *orderedQueue) accept(nm *nats.Msg) error {
	md, err := nm.Metadata()
	if err != nil {
		return nil // not a JetStream delivery
	}
	if md.Sequence.Consumer != q.nextSeq {
		q.o.logger.Info("An ordered group's delivery was missed; recreating its consumer", watermill.LogFields{"expected": q.nextSeq, "got": md.Sequence.Consumer})
		return errRecreate
	}
	q.nextSeq++
	if h := q.bySeq[md.Sequence.Stream]; h != nil {
		h.reply.Store(nm) // delivered again: ack_wait passed
		return nil
	}
	if q.o.acked[md.Sequence.Stream] {
		go func() { _ = nm.AckSync() }() // not acked again: it comes once more
		return nil
	}
	msg, _ := marshaler{}.Unmarshal(nm) // never fails; see marshaler
	msgCtx, cancel := context.WithCancel(q.ctx)
	msg.SetContext(msgCtx)
	h := &heldMsg{seq: md.Sequence.Stream, key: msg.Metadata.Get(envelope.AggregateIDKey), msg: msg, touch: time.Now()}
	h.reply.Store(nm)
	q.bySeq[h.seq], q.cancels[h] = h, cancel
	if queued, busy := q.waiting[h.key]; busy {
		q.waiting[h.key] = append(queued, h)
	} else {
		q.waiting[h.key] = nil
		q.ready = append(q.ready, h)
	}
	return nil
}

// requeue makes a nacked message ready to hand out again, as a fresh copy.
func (q *orderedQueue) requeue(h *heldMsg) {
	h.msg = h.msg.Copy() // a Watermill message is acked or nacked once
	msgCtx, cancel := context.WithCancel(q.ctx)
	h.msg.SetContext(msgCtx)
	q.cancels[h] = cancel
	q.ready = append(q.ready, h)
}

// handOut records that the first ready message went out and waits, aside,
// for its reader's decision.
func (q *orderedQueue) handOut() {
	h := q.ready[0]
	q.ready[0] = nil
	q.ready = q.ready[1:]
	q.unsettled++
	go func() { q.settled <- q.o.settle(h) }()
}

// settle applies a handed-out message's outcome: a nack hands it out again
// after nak_delay (unless stopping), an ack frees its aggregate for the
// next message waiting behind it.
func (q *orderedQueue) settle(st settlement, stopping bool) {
	q.unsettled--
	q.cancels[st.h]()
	delete(q.cancels, st.h)
	if !st.acked && !stopping {
		// Handed out again after nak_delay; its aggregate stays
		// busy meanwhile, the others go on.
		time.AfterFunc(q.o.s.b.cfg.Consumer.NakDelay, func() { q.again <- st.h })
		return
	}
	delete(q.bySeq, st.h.seq)
	if st.confirmed && len(q.o.acked) < maxAckedMemory {
		q.o.acked[st.h.seq] = true
	}
	if !st.acked {
		return
	}
	if queued := q.waiting[st.h.key]; len(queued) > 0 {
		q.waiting[st.h.key] = queued[1:]
		q.ready = append(q.ready, queued[0])
	} else {
		delete(q.waiting, st.h.key)
	}
}

// keepInProgress tells the server that the messages it has not heard of
// for every are still being worked on.
func (q *orderedQueue) keepInProgress(every time.Duration) {
	for _, h := range q.bySeq {
		if time.Since(h.touch) >= every {
			_ = h.reply.Load().InProgress()
			h.touch = time.Now()
		}
	}
}

// settle waits for the reader's decision on h and acks h when it is an Ack,
// waiting for the server's confirmation. A Nack sends nothing: consume
// hands the message out again.
func (o *orderedSubscription) settle(h *heldMsg) settlement {
	ack := func() settlement {
		err := h.reply.Load().AckSync()
		if err != nil {
			// The effect is done; the message comes again, as a duplicate.
			o.logger.Error("Cannot send ack", err, watermill.LogFields{"message_uuid": h.msg.UUID})
		}
		return settlement{h: h, acked: true, confirmed: err == nil}
	}
	select {
	case <-h.msg.Acked():
		return ack()
	case <-h.msg.Nacked():
		return settlement{h: h}
	case <-o.s.closing:
		select {
		case <-h.msg.Acked(): // an Ack given just before the close still goes out
			return ack()
		default:
			return settlement{h: h}
		}
	}
}
