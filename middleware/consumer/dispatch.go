package consumer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/middleware"
)

// Source says how to open a handler's subscriptions and what the broker
// guarantees about them; the Dispatcher decides from it how many to open.
type Source struct {
	// NewSubscriber returns a new subscriber of the handler's consumer
	// group. The Dispatcher calls it once per subscription and closes what it
	// returns. Required.
	NewSubscriber func() (message.Subscriber, error)
	// Competing is true when subscriptions of one consumer group share its
	// messages, each message going to one of them: a RabbitMQ queue, a NATS
	// JetStream durable consumer, a Kafka consumer group. False for
	// Watermill's gochannel, where every subscription gets every message.
	Competing bool
	// KeyPartitioned is true when one subscription already delivers messages
	// of different keys concurrently and those of one key in order: Kafka,
	// where a subscription spans its assigned partitions (its stock one has
	// one message in flight per partition) and the key picks the partition.
	// One subscription is then enough.
	KeyPartitioned bool
	// Concurrent is true when one subscription hands out many messages
	// without waiting for their acks and settles each on its own: for an
	// ordered handler one that keeps the order of what it handed out across
	// nacks and restarts (adapters.Capabilities.OrderedFlight: RabbitMQ,
	// NATS and Kafka), for an unordered one
	// adapters.Capabilities.ConcurrentFlight (the same three). The Dispatcher opens one
	// subscription, and the handler has up to Workers messages in flight
	// from it, one per aggregate when ordered.
	Concurrent bool
	// Parked, when set, opens one more input: the drain of the handler's
	// released parks (consumer.poison.park; Subscriber sets it from
	// Chain.Parked).
	Parked func() (message.Subscriber, error)
}

// Dispatcher is a message.Subscriber that feeds one handler from one or more
// subscriptions with at most consumer.workers messages in flight, and, when
// consumer.ordered is on, never more than one message per aggregate (the
// aggregate-id header; messages without one share a key).
//
// It sits between the broker subscriptions and Watermill's router, which
// starts a goroutine per message it receives: the Dispatcher releases a
// message to the router only when a worker slot is free and, in ordered
// mode, when the previous message of its aggregate was acked. A message of a
// busy aggregate waits in the Dispatcher (at most consumer.prefetch messages
// are held in all) without blocking other aggregates. Messages of one
// aggregate are released in the order the subscription delivered them.
//
// Watermill's stock subscribers deliver the next message of a subscription
// only after the current one is acked, so concurrency comes from the number
// of subscriptions: consumer.workers competing subscriptions when unordered;
// one when ordered (a second would receive the same aggregate's next event
// before the first is acked) and one when KeyPartitioned (a Kafka
// subscription already spans its partitions). With a stock subscriber an
// ordered handler thus has one message in flight; with a Concurrent one
// (the brokers' ordered and concurrent subscribers) its one subscription
// hands out up to consumer.prefetch messages and the Dispatcher runs up to
// consumer.workers of them, one per aggregate when ordered. See README.md
// for what that means on each broker.
//
// Stopping (Close, or the end of Subscribe's context) is graceful: no new
// message is released, held ones are nacked, the contexts of the messages in
// flight are cancelled (retry and breaker waits end and nack; attempts
// already running finish and commit, or are abandoned at handler_timeout
// and nacked), their acks are awaited for up to DrainTimeout while the
// subscriptions are still open to carry them, and only then are the
// subscriptions closed. With Chain's handlers every message in flight is
// settled within handler_timeout of the stop, even when a handler ignores
// its context, so the drain ends before DrainTimeout.
type Dispatcher struct {
	src      Source
	cfg      DispatchConfig
	subs     int
	stopCtx  context.Context
	stop     context.CancelFunc
	finished chan struct{} // closed when run has returned
	// slots carries the pause and resume requests of released messages'
	// worker slots to the scheduler (see workerSlot).
	slots chan slotRequest
	// leases maps each message held to its *workerSlot, for the chain
	// (Lease); the scheduler adds and removes them.
	leases sync.Map

	mu         sync.Mutex
	subscribed bool
	closed     bool
	wg         sync.WaitGroup
}

// DispatchConfig sizes a Dispatcher.
type DispatchConfig struct {
	// Workers is the most messages in flight. Defaults to 1.
	Workers int
	// Prefetch is the most messages held (in flight plus waiting for their
	// key); raised to Workers if lower.
	Prefetch int
	// Ordered releases one message per aggregate at a time.
	Ordered bool
	// DrainTimeout bounds how long stopping waits for the acks of messages
	// in flight. Defaults to 30s.
	DrainTimeout time.Duration
	// Key is the key Ordered keeps the order of, "" for the aggregate-id
	// header. Defaults to the aggregate-id header.
	Key func(msg *message.Message) string
	// Logger defaults to no logging.
	Logger watermill.LoggerAdapter
}

// Subscriber returns the Dispatcher of chain's handler over src, sized by
// the handler's workers, prefetch and ordered settings, draining for up to
// handler_timeout plus 5s when it stops (an attempt running at the stop
// returns or is abandoned within handler_timeout; the 5s are for the nacks
// and acks to reach the broker), and feeding chain (Chain.Feed). Pass it to
// the router as the handler's subscriber, with chain.Wrap(h) as its
// handler; the router's CloseTimeout should exceed that drain.
func Subscriber(chain *middleware.Chain, src Source) *Dispatcher {
	cfg := chain.Config()
	d := NewDispatcher(src, DispatchConfig{
		Workers:      cfg.Workers,
		Prefetch:     cfg.EffectivePrefetch(),
		Ordered:      *cfg.Ordered,
		DrainTimeout: cfg.HandlerTimeout + 5*time.Second,
		Logger:       chain.Logger(),
		Key:          chain.OrderKey,
	})
	d.src.Parked = chain.Parked() // nil unless the chain parks (consumer.poison.park)
	chain.Feed(middleware.Feed{
		Lease: d.lease,
		// One subscription of a stock subscriber holds one message at a time.
		OneAtATime: d.subs == 1 && src.Competing && !src.KeyPartitioned && !src.Concurrent,
	})
	return d
}

// lease is the Lease of msg, a message the Dispatcher released, for the
// chain it feeds.
func (d *Dispatcher) lease(msg *message.Message) middleware.Lease {
	if v, ok := d.leases.Load(msg); ok {
		slot := v.(*workerSlot)
		return middleware.Lease{Worker: slot, Delivery: slot.delivery}
	}
	return middleware.Lease{}
}

// BrokerSource is the Source of chain's handler in consumerGroup on
// broker, with the subscriber bus.Run gives it, decided from the broker's
// Capabilities alone:
//
//   - an unordered handler with retry.mode auto hands the waits between
//     its attempts to a broker that schedules redeliveries
//     (ScheduledRedelivery: NATS and RabbitMQ always, Kafka with retry
//     topics), freeing its workers, with many messages in flight where the
//     broker has ConcurrentFlight; an ordered one keeps them in process,
//     where nothing newer passes;
//   - an ordered handler takes up to consumer.prefetch messages at once
//     from a broker that can settle them out of order and still keep their
//     order (OrderedFlight); the Dispatcher holds those of busy
//     aggregates;
//   - so does an unordered one from a broker whose one subscription can
//     hand out many messages at once (ConcurrentFlight: every millrace
//     adapter), where a stock subscription holds one;
//   - otherwise the broker's stock subscription.
//
// A subscription with a RedeliveryWait records each message's delivery
// number, which the Dispatcher reads into the message's Lease.
func BrokerSource(chain *middleware.Chain, broker adapters.Broker, consumerGroup string) Source {
	caps := broker.Capabilities()
	cfg := chain.Config()
	spec := brokerSpec(caps, adapters.SubscriberSpec{Group: consumerGroup},
		*cfg.Ordered, cfg.Retry.Mode == middleware.RetryAuto, cfg.EffectivePrefetch(), chain.RedeliveryWait)
	return Source{
		NewSubscriber:  func() (message.Subscriber, error) { return broker.Subscriber(spec) },
		Competing:      true,
		KeyPartitioned: caps.KeyPartitioned,
		Concurrent:     spec.InFlight > 0,
	}
}

// brokerSpec completes spec for a handler (ordered or not, with retry.mode
// auto or not, inFlight its consumer.prefetch) on a broker with caps. A
// spec with a RedeliveryWait records its delivery numbers in handedOut,
// where the Dispatcher reads them.
func brokerSpec(caps adapters.Capabilities, spec adapters.SubscriberSpec, ordered, auto bool, inFlight int,
	wait func(int) time.Duration) adapters.SubscriberSpec {
	scheduled := !ordered && auto && caps.ScheduledRedelivery
	switch {
	case ordered && caps.OrderedFlight:
		spec.Ordered, spec.InFlight = true, inFlight
	case scheduled && caps.ConcurrentFlight:
		spec.InFlight, spec.RedeliveryWait = inFlight, wait
	case scheduled && !caps.RedeliveryNeedsFlight:
		spec.RedeliveryWait = wait
	case !ordered && caps.ConcurrentFlight:
		spec.InFlight = inFlight
	}
	if spec.RedeliveryWait != nil {
		spec.Deliveries = &handedOut
	}
	return spec
}

// handedOut holds the delivery numbers of the messages that subscriptions
// with a RedeliveryWait have handed out, until each is settled: the
// subscription records a message's number before the message reaches the
// Dispatcher, which reads it by the message into its Lease. One table
// serves every chain of the process: its keys are the messages themselves,
// so no chain sees another's.
var handedOut adapters.Deliveries

// NewDispatcher returns a Dispatcher over src. Subscriber is the usual way
// to get one: a Dispatcher from NewDispatcher feeds no chain, so the
// messages it releases give no worker back while they wait.
func NewDispatcher(src Source, cfg DispatchConfig) *Dispatcher {
	cfg.Workers = max(cfg.Workers, 1)
	cfg.Prefetch = max(cfg.Prefetch, cfg.Workers)
	if cfg.DrainTimeout <= 0 {
		cfg.DrainTimeout = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	subs := cfg.Workers
	if !src.Competing || src.KeyPartitioned || src.Concurrent || cfg.Ordered {
		subs = 1
	}
	stopCtx, stop := context.WithCancel(context.Background())
	return &Dispatcher{src: src, cfg: cfg, subs: subs, stopCtx: stopCtx, stop: stop, finished: make(chan struct{}),
		slots: make(chan slotRequest)}
}

// ackGrace is how long a stopping Dispatcher waits, after the last message in
// flight was acked, before it closes the subscriptions that carry the acks.
const ackGrace = 250 * time.Millisecond

// Subscriptions is how many subscriptions Subscribe opens.
func (d *Dispatcher) Subscriptions() int { return d.subs }

// subscription is one open subscription and what ends it.
type subscription struct {
	sub    message.Subscriber
	ch     <-chan *message.Message
	cancel context.CancelFunc
}

// close closes the subscriber, then ends its context: in that order, since
// watermill-amqp v2.1.3 races (and may reconnect) when the Subscribe context
// ends before Close.
func (s subscription) close() error {
	err := s.sub.Close()
	s.cancel()
	return err
}

// Subscribe opens the subscriptions on topic and returns the channel the
// router reads. It may be called once. When ctx ends the Dispatcher stops as
// Close does, and the channel is closed once it has.
func (d *Dispatcher) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.closed:
		return nil, errors.New("millrace dispatcher: closed")
	case d.subscribed:
		return nil, errors.New("millrace dispatcher: Subscribe may be called once; build a Dispatcher per handler")
	case d.src.NewSubscriber == nil:
		return nil, errors.New("millrace dispatcher: Source.NewSubscriber is nil")
	}
	opens := slices.Repeat([]func() (message.Subscriber, error){d.src.NewSubscriber}, d.subs)
	if d.src.Parked != nil {
		opens = append(opens, d.src.Parked)
	}
	subs := make([]subscription, 0, len(opens))
	for _, open := range opens {
		// Each subscription gets a context of its own, ended only after it is
		// closed: it must outlive ctx to carry the acks of the messages in flight.
		subCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		sub, err := open()
		if err == nil {
			var ch <-chan *message.Message
			if ch, err = sub.Subscribe(subCtx, topic); err == nil {
				subs = append(subs, subscription{sub: sub, ch: ch, cancel: cancel})
				continue
			}
			err = errors.Join(err, sub.Close())
		}
		cancel()
		for _, s := range subs {
			err = errors.Join(err, s.close())
		}
		return nil, fmt.Errorf("millrace dispatcher: subscribe to %s: %w", topic, err)
	}
	d.subscribed = true
	context.AfterFunc(ctx, d.stop)
	out := make(chan *message.Message)
	go func() {
		defer close(d.finished)
		d.run(subs, out)
	}()
	return out, nil
}

// Close stops the Dispatcher (see the type's comment) and returns when its
// subscriptions are closed and its goroutines have ended. It is idempotent.
func (d *Dispatcher) Close() error {
	d.mu.Lock()
	alreadyClosed, started := d.closed, d.subscribed
	d.closed = true
	d.mu.Unlock()
	d.stop()
	if alreadyClosed {
		return nil
	}
	if started {
		<-d.finished
	}
	d.wg.Wait()
	return nil
}

// run is the scheduler: it owns every queue, so it needs no lock. It feeds
// the router until the Dispatcher stops or its subscriptions end, then
// drains what is in flight and lets the subscriptions close.
func (d *Dispatcher) run(subs []subscription, out chan<- *message.Message) {
	defer close(out)
	drained := make(chan struct{})
	in, inputsDone := d.fanIn(subs, drained)
	// A watcher per released message reports its ack or nack here; the
	// buffer (one per worker slot) means a watcher never blocks.
	finished := make(chan finishedMsg, d.cfg.Workers)
	s := newSchedule(d.cfg.Ordered, d.cfg.Workers, d.cfg.Key, &d.leases)
	d.dispatch(s, in, out, inputsDone, finished)
	d.stop() // when the subscriptions ended by themselves
	s.nackHeld()
	d.drain(s, finished)
	close(drained)
	<-inputsDone
}

// fanIn starts one goroutine per subscription (feed) that forwards its
// messages to in, in order. inputsDone is closed when every subscription
// is closed and its goroutine has ended; drained tells them the messages in
// flight have been acked.
func (d *Dispatcher) fanIn(subs []subscription, drained <-chan struct{}) (in chan *message.Message, inputsDone chan struct{}) {
	in = make(chan *message.Message)
	inputsDone = make(chan struct{})
	var wg sync.WaitGroup
	for _, sub := range subs {
		wg.Go(func() { d.feed(sub, in, drained) })
	}
	go func() {
		wg.Wait()
		close(inputsDone)
	}()
	return in, inputsDone
}

// feed forwards one subscription's messages to in until the Dispatcher
// stops. Then it releases nothing more but keeps taking what the
// subscription delivers until the messages in flight are drained, closes
// the subscription and nacks what it took: a subscription left blocked on
// its output channel races with its own Close (watermill-nats v2.1.3), and
// one nacked while we drain gets the message straight back, in a loop.
// Closing from this goroutine also orders every receive before the Close.
func (d *Dispatcher) feed(sub subscription, in chan<- *message.Message, drained <-chan struct{}) {
	held, open := d.deliver(sub, in)
	defer func() {
		for _, m := range held {
			m.Nack()
		}
	}()
	if !open {
		_ = sub.close()
		return
	}
	for {
		select {
		case msg, ok := <-sub.ch:
			if !ok {
				_ = sub.close()
				return
			}
			held = append(held, msg)
		case <-drained:
			if err := sub.close(); err != nil {
				d.cfg.Logger.Error("Closing a subscription failed", err, nil)
			}
			for msg := range sub.ch {
				held = append(held, msg)
			}
			return
		}
	}
}

// deliver forwards sub's messages to in until the Dispatcher stops; it
// returns the message it took but could not forward, and whether the
// subscription is still open.
func (d *Dispatcher) deliver(sub subscription, in chan<- *message.Message) (held []*message.Message, open bool) {
	stopping := d.stopCtx.Done()
	for {
		select {
		case msg, ok := <-sub.ch:
			if !ok {
				return nil, false
			}
			select {
			case in <- msg:
			case <-stopping:
				return []*message.Message{msg}, true
			}
		case <-stopping:
			return nil, true
		}
	}
}

// dispatch releases messages from in to the router (out) as worker slots
// and, in ordered mode, their aggregates allow, until the Dispatcher stops
// or every subscription has ended.
func (d *Dispatcher) dispatch(s *schedule, in <-chan *message.Message, out chan<- *message.Message, inputsDone <-chan struct{}, finished chan finishedMsg) {
	stopping := d.stopCtx.Done()
	for {
		var recv <-chan *message.Message
		if s.held < d.cfg.Prefetch {
			recv = in
		}
		var send chan<- *message.Message
		var next *message.Message
		if len(s.ready) > 0 && s.working() < d.cfg.Workers && len(s.resumers) == 0 {
			send, next = out, s.ready[0]
		}
		select {
		case msg := <-recv:
			// The message's context ends when it is finished or the
			// Dispatcher stops, whichever is first (see watch).
			ctx, cancel := context.WithCancel(msg.Context())
			msg.SetContext(ctx)
			delivery, _ := handedOut.Number(msg)
			s.add(msg, cancel, &workerSlot{d: d, delivery: delivery})
		case send <- next:
			cancel := s.release()
			d.wg.Add(1)
			go d.watch(next, cancel, finished)
		case f := <-finished:
			for _, m := range s.finish(f.msg, f.acked) {
				m.Nack()
			}
		case req := <-d.slots:
			s.onSlotRequest(req)
		case <-inputsDone:
			return
		case <-stopping:
			return
		}
	}
}

// drain waits up to DrainTimeout for the acks of the messages in flight,
// while the subscriptions that carry them are still open.
func (d *Dispatcher) drain(s *schedule, finished <-chan finishedMsg) {
	if s.inFlight == 0 {
		return
	}
	timeout := time.NewTimer(d.cfg.DrainTimeout)
	defer timeout.Stop()
	for s.inFlight > 0 {
		select {
		case f := <-finished:
			s.finish(f.msg, f.acked)
		case req := <-d.slots:
			s.onSlotRequest(req)
		case <-timeout.C:
			d.cfg.Logger.Error("Dispatcher stopped before every message in flight was acked; they will be redelivered",
				nil, watermill.LogFields{"in_flight": s.inFlight, "drain_timeout": d.cfg.DrainTimeout.String()})
			s.inFlight = 0
			for _, req := range s.resumers {
				close(req.grant)
			}
			s.resumers = nil
		}
	}
	// Watermill's subscribers pick at random between an ack and a close
	// that are both ready: let the acks just given leave first, or their
	// messages come back (as duplicates the inbox absorbs).
	time.Sleep(ackGrace)
}

type finishedMsg struct {
	msg   *message.Message
	acked bool
}

// watch reports when the router acks or nacks msg, and ends msg's context
// when the Dispatcher stops, so that the chain's waits end.
func (d *Dispatcher) watch(msg *message.Message, cancel context.CancelFunc, finished chan<- finishedMsg) {
	defer d.wg.Done()
	defer cancel()
	stopping := d.stopCtx.Done()
	for {
		select {
		case <-msg.Acked():
			finished <- finishedMsg{msg, true}
			return
		case <-msg.Nacked():
			finished <- finishedMsg{msg, false}
			return
		case <-stopping:
			cancel()
			stopping = nil
		case <-d.finished:
			return
		}
	}
}

// schedule holds the messages the Dispatcher received but the router has not
// finished: ready to release, in flight, or waiting for their key.
type schedule struct {
	ordered bool
	workers int
	key     func(msg *message.Message) string // nil: the aggregate
	ready   []*message.Message
	// waiting maps each key with a message ready or in flight to the
	// messages queued behind it, in delivery order.
	waiting map[string][]*message.Message
	// cancels ends the context the Dispatcher gave each held message.
	cancels  map[*message.Message]context.CancelFunc
	held     int // received and not finished
	inFlight int // released and not finished
	// workerSlots maps the messages held to their *workerSlot (the
	// Dispatcher's leases, which the chain reads); paused counts those in
	// flight waiting off their worker, resumers those asking for one back.
	workerSlots *sync.Map
	paused      int
	resumers    []slotRequest
}

func newSchedule(ordered bool, workers int, key func(*message.Message) string, slots *sync.Map) *schedule {
	return &schedule{
		ordered:     ordered,
		workers:     workers,
		key:         key,
		waiting:     map[string][]*message.Message{},
		cancels:     map[*message.Message]context.CancelFunc{},
		workerSlots: slots,
	}
}

// working counts the messages in flight that hold a worker.
func (s *schedule) working() int { return s.inFlight - s.paused }

// keyOf is the key msg is ordered by: the schedule's key, else its aggregate.
func (s *schedule) keyOf(msg *message.Message) string {
	if s.key != nil {
		if k := s.key(msg); k != "" {
			return k
		}
	}
	return msg.Metadata.Get(envelope.AggregateIDKey)
}

func (s *schedule) add(msg *message.Message, cancel context.CancelFunc, slot *workerSlot) {
	s.held++
	s.cancels[msg] = cancel
	s.workerSlots.Store(msg, slot)
	if !s.ordered {
		s.ready = append(s.ready, msg)
		return
	}
	k := s.keyOf(msg)
	if queue, busy := s.waiting[k]; busy {
		s.waiting[k] = append(queue, msg)
		return
	}
	s.waiting[k] = nil
	s.ready = append(s.ready, msg)
}

// release takes the first ready message as in flight and returns the
// cancel function of its context.
func (s *schedule) release() context.CancelFunc {
	msg := s.ready[0]
	s.ready[0] = nil
	s.ready = s.ready[1:]
	s.inFlight++
	cancel := s.cancels[msg]
	delete(s.cancels, msg)
	return cancel
}

// finish frees msg's slot and, in ordered mode, readies the next message of
// its key. When msg was nacked, the messages queued behind it are returned
// to be nacked too: its redelivery must come before them.
func (s *schedule) finish(msg *message.Message, acked bool) (nack []*message.Message) {
	s.held--
	s.inFlight--
	s.releaseSlot(msg)
	s.grantResumers()
	if !s.ordered {
		return nil
	}
	k := s.keyOf(msg)
	queue := s.waiting[k]
	switch {
	case len(queue) == 0:
		delete(s.waiting, k)
	case !acked:
		delete(s.waiting, k)
		s.held -= len(queue)
		for _, m := range queue {
			s.drop(m)
		}
		return queue
	default:
		s.ready = append(s.ready, queue[0])
		s.waiting[k] = queue[1:]
	}
	return nil
}

func (s *schedule) drop(msg *message.Message) {
	s.workerSlots.Delete(msg)
	if cancel, ok := s.cancels[msg]; ok {
		cancel()
		delete(s.cancels, msg)
	}
}

// nackHeld nacks every message received but not released, for redelivery.
func (s *schedule) nackHeld() {
	for _, m := range s.ready {
		s.drop(m)
		m.Nack()
	}
	for _, queue := range s.waiting {
		for _, m := range queue {
			s.drop(m)
			m.Nack()
		}
	}
	s.held -= len(s.ready)
	for _, queue := range s.waiting {
		s.held -= len(queue)
	}
	s.ready, s.waiting = nil, map[string][]*message.Message{}
}
