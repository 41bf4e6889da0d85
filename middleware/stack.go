package middleware

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/sleep"
	"github.com/millrace-io/millrace/internal/store"
)

// Deps are what a Stack needs from the service around it.
type Deps struct {
	// DB holds the inbox, aggregate-versions and poison tables (created by
	// `millrace migrate` or bus.Migrate). Required unless the inbox, the
	// ordering guard and the table poison destination are all off.
	DB *sql.DB
	// Schema is the PostgreSQL schema of those tables. Defaults to "public".
	Schema string
	// PoisonPublisher publishes poisoned messages when poison.destination is
	// "topic" (for any handler). Required then; unused otherwise.
	PoisonPublisher message.Publisher
	// Registerer receives the metrics collectors (nothing is registered
	// globally). Nil means no metrics.
	Registerer prometheus.Registerer
	// Logger receives the chain's logs: one line at info per failed
	// attempt, one per poisoned message (with its reason) at warn when
	// Logger has a Warn(msg string, fields watermill.LogFields) method, as
	// bus.WithLogger's has, else at info. Defaults to no logging.
	Logger watermill.LoggerAdapter
	// BeginTx begins the inbox transaction of one attempt on the attempt's
	// context (see Transaction), when it is not to be a database/sql one.
	// DB is still required for the tables. Defaults to DB.BeginTx(ctx, nil).
	BeginTx func(ctx context.Context) (Transaction, error)
}

// Handler identifies one consumer handler.
type Handler struct {
	// Name is the handler's name: the key of its config override, a metric
	// label and the handler column of poisoned messages. Required.
	Name string
	// Topic is the topic the handler consumes (recorded when a message is poisoned). Required.
	Topic string
	// ConsumerGroup is the handler's consumer group; the inbox deduplicates
	// per consumer group, so two handlers with the inbox on need two groups. Required.
	ConsumerGroup string
	// Probe checks the handler's dependencies, so that the breaker can tell
	// a dependency outage (the failed attempt is not counted, the breaker
	// waits until the probe passes) from a bad message (poisoned after its
	// attempts); see ProbeFunc. It needs breaker.enabled. Defaults to none.
	Probe ProbeFunc
	// Takes, when set, says whether the handler takes a message: one it
	// does not take (an event of a type a typed handler has no route for)
	// is acked at once, without an attempt, an inbox row or a call of the
	// handler, and counted as OutcomeOtherType. Defaults to taking every
	// message.
	Takes func(msg *message.Message) bool
	// OrderKey, when set, is the key an ordered handler keeps the order of
	// (a saga's correlation id) in place of the aggregate-id header; a
	// message it gives "" is ordered by its aggregate. Defaults to the
	// aggregate.
	OrderKey func(msg *message.Message) string
	// Lag, when set, observes for each message the chain processed (not
	// given back to the broker) the seconds since its event occurred.
	Lag prometheus.Observer
}

// Stack builds the middleware chain of each handler of a service and owns
// what the chains share: configuration, metrics, database. Build one per
// service with New, then one Chain per handler.
type Stack struct {
	cfg     Config
	db      *sql.DB
	beginTx func(ctx context.Context) (Transaction, error)
	tables  store.Tables
	poison  message.Publisher
	logger  watermill.LoggerAdapter
	metrics *metrics
	// now and sleep are the clock; tests replace them.
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) error

	mu     sync.Mutex
	chains map[string]*Chain
	groups map[string]string // consumer group -> handler, for handlers with the inbox on
	// inboxGroups are the groups millrace_inbox_rows reported last.
	inboxGroups map[string]int64
}

// New validates cfg (after WithDefaults, under the YAML path "consumer") and
// returns a Stack. It does no I/O; call Check to verify the tables exist.
func New(cfg Config, deps Deps) (*Stack, error) {
	cfg = cfg.WithDefaults()
	if errs := cfg.Validate("consumer"); len(errs) > 0 {
		return nil, fmt.Errorf("millrace consumer config: %w", errors.Join(errs...))
	}
	schema := cmp.Or(deps.Schema, "public")
	if err := names.Schema(schema, store.MaxIdentifierLength); err != nil {
		return nil, fmt.Errorf("millrace consumer: schema: %w", err)
	}
	m, err := newMetrics(deps.Registerer)
	if err != nil {
		return nil, err
	}
	s := &Stack{
		cfg:     cfg,
		db:      deps.DB,
		beginTx: deps.BeginTx,
		tables:  store.Tables{Schema: schema},
		poison:  deps.PoisonPublisher,
		logger:  deps.Logger,
		metrics: m,
		now:     time.Now,
		sleep:   sleepFor,
		chains:  map[string]*Chain{},
		groups:  map[string]string{},
	}
	if s.logger == nil {
		s.logger = watermill.NopLogger{}
	}
	return s, nil
}

// Config returns the configuration the Stack runs with, defaults applied.
func (s *Stack) Config() Config { return s.cfg }

// Check verifies that the tables the configuration needs exist, so that a
// missing migration is reported at start rather than as failing messages.
func (s *Stack) Check(ctx context.Context) error {
	if s.db == nil {
		return nil
	}
	tables := append([]string{s.tables.InboxTable(), s.tables.PoisonTable(), s.tables.AggregateVersionsTable()}, parkTables(s.tables)...)
	missing, err := store.Missing(ctx, s.db, tables...)
	if err != nil {
		return fmt.Errorf("millrace consumer: check tables: %w", err)
	}
	if missing != "" {
		return fmt.Errorf("millrace consumer: table %s does not exist: run `millrace migrate` or bus.Migrate first", missing)
	}
	return nil
}

// Chain is the middleware chain of one handler.
type Chain struct {
	stack   *Stack
	spec    Handler
	cfg     Config
	breaker *breaker
	// poisonTopic is the topic Watermill's poison queue names; the
	// destination is poison.destination's.
	poisonTopic string
	counter     func(outcome string) prometheus.Counter
	timer       prometheus.Observer
	// abandoned counts attempts abandoned at handler_timeout; running
	// gauges those whose goroutine has not returned yet.
	abandoned prometheus.Counter
	running   prometheus.Gauge
	// batcher groups inbox transactions; nil with batch.max_messages 1.
	batcher   *batcher
	batchSize prometheus.Observer
	// drained are the messages a park's drain handed on (see park);
	// parkedGauge counts the handler's parks.
	drained     sync.Map
	parkedGauge prometheus.Gauge
	// leases is the runtime's source of each message's Lease (Feed).
	leases leaseSource
	// activity is the chain's progress for Activity.
	activity *activity
}

// Chain builds the chain of one handler with its configuration
// (Config.For(h.Name)). Each handler name gets one chain.
func (s *Stack) Chain(h Handler) (*Chain, error) {
	var chk confload.Checker
	// The name is a metric label, a config key and a poison-table column.
	if h.Name == "" {
		chk.Add("handler.name", "required")
	} else {
		chk.Check("handler.name", names.Topic(h.Name))
	}
	chk.Check("handler.topic", names.Topic(h.Topic))
	chk.Check("handler.consumer_group", names.Topic(h.ConsumerGroup))
	if len(chk.Problems) > 0 {
		return nil, fmt.Errorf("millrace consumer: handler %q: %w", h.Name, errors.Join(chk.Problems...))
	}
	cfg := s.cfg.For(h.Name)
	needsDB := *cfg.Inbox.Enabled || *cfg.OrderingGuard || cfg.Poison.Destination == PoisonToTable
	switch {
	case needsDB && s.db == nil:
		return nil, fmt.Errorf("millrace consumer: handler %q: Deps.DB is required for the inbox, the ordering guard and the poison table", h.Name)
	case h.Probe != nil && !*cfg.Breaker.Enabled:
		return nil, fmt.Errorf("millrace consumer: handler %q: a dependency probe needs the circuit breaker, but %s is false", h.Name, breakerEnabledPath(s.cfg, h.Name))
	case cfg.Poison.Destination == PoisonToTopic && s.poison == nil:
		return nil, fmt.Errorf("millrace consumer: handler %q: poison.destination is topic but Deps.PoisonPublisher is nil", h.Name)
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	if _, dup := s.chains[h.Name]; dup {
		return nil, fmt.Errorf("millrace consumer: handler %q already has a chain", h.Name)
	}
	if *cfg.Inbox.Enabled {
		if other, taken := s.groups[h.ConsumerGroup]; taken {
			return nil, fmt.Errorf("millrace consumer: handlers %q and %q share consumer group %q with the inbox on: "+
				"the inbox deduplicates per group, so the second would skip every event the first processed", other, h.Name, h.ConsumerGroup)
		}
		s.groups[h.ConsumerGroup] = h.Name
	}

	c := &Chain{
		stack:    s,
		spec:     h,
		cfg:      cfg,
		activity: newActivity(),
		counter: func(outcome string) prometheus.Counter {
			return s.metrics.messages.WithLabelValues(h.Name, h.ConsumerGroup, outcome)
		},
		timer:     s.metrics.duration.WithLabelValues(h.Name),
		abandoned: s.metrics.abandoned.WithLabelValues(h.Name),
		running:   s.metrics.running.WithLabelValues(h.Name),
		batchSize: s.metrics.batchSize.WithLabelValues(h.Name),
		// Parking: park.go.
		parkedGauge: s.metrics.parked.WithLabelValues(h.Name),
	}
	if (*cfg.Inbox.Enabled || *cfg.OrderingGuard) && cfg.Batch.MaxMessages > 1 {
		c.batcher = newBatcher(c)
	}
	// Every outcome's series exists from the start, so dashboards and
	// alerts see zeros rather than nothing before the first message.
	for _, outcome := range []string{OutcomeOK, OutcomeDuplicate, OutcomeStale, OutcomeOtherType, OutcomePoisoned, OutcomeRetried, OutcomeNacked, OutcomeNotTargeted, OutcomeParked, OutcomeSkipped} {
		c.counter(outcome)
	}
	if *cfg.Breaker.Enabled {
		c.breaker = newBreaker(h.Name, cfg.Breaker, s.metrics.breaker.WithLabelValues(h.Name), s.logger)
		c.breaker.probe, c.breaker.probeTimeout = h.Probe, cfg.HandlerTimeout
	} else {
		s.metrics.breaker.WithLabelValues(h.Name).Set(BreakerClosed)
	}
	c.poisonTopic = cmp.Or(cfg.Poison.Topic, "millrace_poison")
	s.chains[h.Name] = c
	return c, nil
}

// Config returns the handler's effective configuration.
func (c *Chain) Config() Config { return c.cfg }

// Handler returns the handler the chain was built for.
func (c *Chain) Handler() Handler { return c.spec }

// Logger returns the logger of the chain's Stack (Deps.Logger), for the
// runtime that feeds the chain.
func (c *Chain) Logger() watermill.LoggerAdapter { return c.stack.logger }

// stages returns the chain, outermost first. The stages pass the
// message's inflight down (observe gives it its delivery state, the attempt
// stage its attempt state), so they only work together and in this order:
// Wrap is the way to use them.
func (c *Chain) stages() []stage {
	stages := []stage{
		c.observe,
		c.target,
		recoverer, // a panic in the chain itself: nack, never lose the message
	}
	if c.spec.Takes != nil {
		stages = append(stages, c.sift)
	}
	if c.cfg.Parks() {
		stages = append(stages, c.park) // park.go
	}
	stages = append(stages,
		c.poisonQueue,
		c.validate,
		c.retry,
	)
	if c.breaker != nil {
		stages = append(stages, c.breaker.stage)
	}
	stages = append(stages, c.attempt)
	switch {
	case c.batcher != nil:
		stages = append(stages, c.transactionBatched)
	case *c.cfg.Inbox.Enabled || *c.cfg.OrderingGuard:
		stages = append(stages, c.transaction)
	}
	return append(stages, recoverer) // a panic in the handler: a retryable error, the transaction rolls back
}

// Wrap returns h wrapped in the whole chain, for
// router.AddConsumerHandler(name, topic, subscriber, chain.Wrap(h)). It is
// where the chain meets Watermill: below it the stages pass the message's
// inflight down, and only the handler's context carries values (Tx,
// CurrentTx, Attempt).
func (c *Chain) Wrap(h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	next := handle(h, c.activity)
	stages := c.stages()
	for i := len(stages) - 1; i >= 0; i-- {
		next = stages[i](next)
	}
	return func(msg *message.Message) (err error) {
		c.activity.move(1)
		defer func() {
			c.activity.move(-1)
			if err == nil {
				c.observeLag(msg)
			}
		}()
		return next(&inflight{msg: msg, lease: c.leaseOf(msg)})
	}
}

// handle is the innermost step: the handler, called with its message's
// context carrying the attempt's transaction and number, each call
// recorded in act.
func handle(h message.NoPublishHandlerFunc, act *activity) step {
	return func(m *inflight) error {
		defer act.call()()
		ctx := m.msg.Context()
		attempt := 0
		if m.a != nil {
			attempt = m.a.number
		}
		m.msg.SetContext(withHandling(ctx, m.tx, attempt))
		err := h(m.msg)
		m.msg.SetContext(ctx)
		return err
	}
}

// recoverer is Watermill's Recoverer as a stage.
var recoverer = watermillStage(wmw.Recoverer)

// watermillStage runs Watermill's middleware mw as a stage: around the
// rest of the chain, on the message's inflight.
func watermillStage(mw message.HandlerMiddleware) stage {
	return func(next step) step {
		return func(m *inflight) error {
			_, err := mw(func(*message.Message) ([]*message.Message, error) { return nil, next(m) })(m.msg)
			return err
		}
	}
}

// observe is the outermost stage: it gives the message its delivery state
// and counts the outcome.
func (c *Chain) observe(next step) step {
	return func(m *inflight) error {
		if c.batcher != nil {
			c.batcher.enter()
			defer c.batcher.leave()
		}
		d := &delivery{eventID: eventIDOf(m.msg)}
		m.d = d
		err := next(m)
		outcome := cmp.Or(d.outcome, OutcomeOK)
		if err != nil && !errors.As(err, new(*redeliverError)) { // redelivered: counted as retried
			outcome = OutcomeNacked
			c.stack.logger.Info("Message returned to the broker for redelivery", c.logFields(d, watermill.LogFields{"reason": err.Error()}))
		}
		c.counter(outcome).Inc()
		return err
	}
}

// target acks a replay meant for other consumer groups (ReplayGroupsKey)
// at once: nothing below runs, so neither the handler nor the inbox nor
// the ordering guard sees it. It is the one place that rule is applied,
// for every handler (plain, typed, batch, saga, ordered) on every broker.
func (c *Chain) target(next step) step {
	return func(m *inflight) error {
		groups, replay := m.msg.Metadata[ReplayGroupsKey]
		if replay && !slices.Contains(strings.Split(groups, ReplayGroupsSeparator), c.spec.ConsumerGroup) {
			m.d.outcome = OutcomeNotTargeted
			return nil
		}
		return next(m)
	}
}

// sift acks a message the handler does not take (Handler.Takes) without
// running the rest of the chain: no attempt, no inbox row, no handler call.
func (c *Chain) sift(next step) step {
	return func(m *inflight) error {
		if c.spec.Takes(m.msg) {
			return next(m)
		}
		m.d.outcome = OutcomeOtherType
		return nil
	}
}

// attempt bounds one attempt by handler_timeout. The attempt runs on a
// context that a shutdown does not cancel (context.WithoutCancel): work
// that started finishes and commits. Watermill's Timeout middleware is not
// used because it derives from the message's context and never restores it
// (Watermill issue #467), and because it only cancels the context: a
// handler that ignores its context would hold its worker, and a stop, for
// as long as it blocks.
//
// The inner part (inbox transaction and handler) runs in a goroutine of its
// own, on a copy of the message and with an attemptState of its own. When
// it has not returned at handler_timeout the attempt is abandoned: the
// stage returns an *abandonedError (retryable, a failed attempt of the
// message), the transaction, begun on the attempt's context, is rolled back
// and can no longer commit (see transaction), the worker is freed, and the
// goroutine is left to finish; since it touches only its copy, it cannot
// race with the next attempt or the poison queue. A retryable failure that
// returns once handler_timeout has passed is a *timedOutError. A panic in
// the inner part is raised again here, where the chain's Recoverer turns it
// into a nack as before, and a runtime.Goexit ends this goroutine too.
func (c *Chain) attempt(next step) step {
	timeout := c.cfg.HandlerTimeout
	return func(m *inflight) error {
		d := m.d
		d.attempts++
		ctx, cancel := context.WithTimeout(context.WithoutCancel(m.msg.Context()), timeout)
		defer cancel()
		state := &attemptState{eventID: d.eventID, number: d.attempts}
		// The delivery and the worker stay with this goroutine: the inner
		// part gets a copy of the message and its own attempt state.
		inner := &inflight{msg: m.msg.Copy(), a: state}
		inner.msg.SetContext(ctx)
		run := &innerAttempt{done: make(chan struct{})}
		start := time.Now()
		go c.runInner(next, inner, run, c.logFields(d, nil))

		select {
		case <-run.done:
		case <-ctx.Done():
			c.running.Inc()
			if run.phase.CompareAndSwap(innerRunning, innerAbandoned) {
				c.timer.Observe(time.Since(start).Seconds())
				c.abandoned.Inc()
				c.stack.logger.Error("Attempt abandoned: it did not return within handler_timeout; the handler ignores its context. "+
					"It is left to finish in the background; its transaction is rolled back", nil,
					c.logFields(d, watermill.LogFields{"handler_timeout": timeout.String()}))
				return &abandonedError{timeout: timeout}
			}
			c.running.Dec()
			<-run.done // it returned as the deadline passed
		}
		c.timer.Observe(time.Since(start).Seconds())
		switch {
		case run.panicked != nil:
			panic(run.panicked)
		case run.exited:
			// The inner part ended its goroutine (runtime.Goexit, as a test
			// simulating a dead process or calling t.FailNow does): end
			// this one too, as it did when the attempt ran inline.
			runtime.Goexit()
		}
		if state.outcome != "" {
			d.outcome = state.outcome
		}
		// By the clock, not ctx.Err(): a transaction begun on a context of
		// the same deadline can fail before this context's timer fires.
		if deadline, _ := ctx.Deadline(); run.err != nil && !time.Now().Before(deadline) && IsRetryable(run.err) {
			return &timedOutError{err: run.err}
		}
		return run.err
	}
}

// Phases of an attempt's inner goroutine; whichever of it and the attempt
// stage moves the phase first decides whether its result is used.
const (
	innerRunning int32 = iota
	innerReturned
	innerAbandoned
)

// innerAttempt is the inner part of one attempt as the attempt stage sees
// it. The result fields are written before done is closed, and read only
// after, and only when the attempt was not abandoned.
type innerAttempt struct {
	phase    atomic.Int32
	done     chan struct{}
	err      error
	panicked any  // what it panicked with
	exited   bool // it called runtime.Goexit
}

// runInner runs the inner part of an attempt and reports its result, or,
// when the attempt was abandoned meanwhile, logs (with logFields) that it
// finished.
func (c *Chain) runInner(next step, m *inflight, run *innerAttempt, logFields watermill.LogFields) {
	returned := false
	defer func() {
		if !returned {
			if p := recover(); p != nil {
				run.panicked = fmt.Errorf("panic in the attempt: %v\n%s", p, debug.Stack())
			} else {
				run.exited = true
			}
		}
		if !run.phase.CompareAndSwap(innerRunning, innerReturned) {
			c.running.Dec()
			result := "returned nil"
			switch {
			case run.panicked != nil:
				result = fmt.Sprint(run.panicked)
			case run.exited:
				result = "runtime.Goexit"
			case run.err != nil:
				result = run.err.Error()
			}
			c.stack.logger.Info("An abandoned attempt finished; its result is dropped", logFields.Add(watermill.LogFields{"result": result}))
		}
		close(run.done)
	}()
	run.err = next(m)
	returned = true
}

// warner is a logger with a warn level; Watermill's LoggerAdapter has
// none.
type warner interface {
	Warn(msg string, fields watermill.LogFields)
}

// warn logs msg at warn level, or at info on a logger without one: what an
// operator should look at, which is no fault of the process.
func (s *Stack) warn(msg string, fields watermill.LogFields) {
	if w, ok := s.logger.(warner); ok {
		w.Warn(msg, fields)
		return
	}
	s.logger.Info(msg, fields)
}

func (c *Chain) logFields(d *delivery, extra watermill.LogFields) watermill.LogFields {
	f := watermill.LogFields{
		"handler":        c.spec.Name,
		"topic":          c.spec.Topic,
		"consumer_group": c.spec.ConsumerGroup,
		"event_id":       d.eventID,
		"attempts":       d.attempts,
	}
	return f.Add(extra)
}

// sleepFor is sleep.For as the stack's sleep: nil after d, the context's
// cause once it ends first.
func sleepFor(ctx context.Context, d time.Duration) error {
	if sleep.For(ctx, d) {
		return nil
	}
	return context.Cause(ctx)
}
