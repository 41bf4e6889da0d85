package middleware

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/pgschema"
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
	// Logger receives the chain's logs. Defaults to no logging.
	Logger watermill.LoggerAdapter
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
}

// Stack builds the middleware chain of each handler of a service and owns
// what the chains share: configuration, metrics, database. Build one per
// service with New, then one Chain per handler.
type Stack struct {
	cfg     Config
	db      *sql.DB
	tables  pgschema.Tables
	poison  message.Publisher
	logger  watermill.LoggerAdapter
	metrics *metrics
	// now and sleep are the clock; tests replace them.
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) error

	mu     sync.Mutex
	chains map[string]*Chain
	groups map[string]string // consumer group -> handler, for handlers with the inbox on
}

// New validates cfg (after WithDefaults, under the YAML path "consumer") and
// returns a Stack. It does no I/O; call Check to verify the tables exist.
func New(cfg Config, deps Deps) (*Stack, error) {
	cfg = cfg.WithDefaults()
	if errs := cfg.Validate("consumer"); len(errs) > 0 {
		return nil, fmt.Errorf("millrace consumer config: %w", errors.Join(errs...))
	}
	schema := cmp.Or(deps.Schema, "public")
	if err := names.Schema(schema, pgschema.MaxIdentifierLength); err != nil {
		return nil, fmt.Errorf("millrace consumer: schema: %w", err)
	}
	m, err := newMetrics(deps.Registerer)
	if err != nil {
		return nil, err
	}
	s := &Stack{
		cfg:     cfg,
		db:      deps.DB,
		tables:  pgschema.Tables{Schema: schema},
		poison:  deps.PoisonPublisher,
		logger:  deps.Logger,
		metrics: m,
		now:     time.Now,
		sleep:   sleepCtx,
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
	for _, table := range []string{s.tables.Inbox(), s.tables.Poison(), s.tables.AggregateVersions()} {
		var exists bool
		if err := s.db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
			return fmt.Errorf("millrace consumer: check table %s: %w", table, err)
		}
		if !exists {
			return fmt.Errorf("millrace consumer: table %s does not exist: run `millrace migrate` or bus.Migrate first", table)
		}
	}
	return nil
}

// Chain is the middleware chain of one handler.
type Chain struct {
	stack   *Stack
	spec    Handler
	cfg     Config
	breaker *breaker
	poison  message.HandlerMiddleware
	counter func(outcome string) prometheus.Counter
	timer   prometheus.Observer
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
		stack: s,
		spec:  h,
		cfg:   cfg,
		counter: func(outcome string) prometheus.Counter {
			return s.metrics.messages.WithLabelValues(h.Name, h.ConsumerGroup, outcome)
		},
		timer: s.metrics.duration.WithLabelValues(h.Name),
	}
	if *cfg.Breaker.Enabled {
		c.breaker = newBreaker(h.Name, cfg.Breaker, s.metrics.breaker.WithLabelValues(h.Name), s.logger)
	} else {
		s.metrics.breaker.WithLabelValues(h.Name).Set(BreakerClosed)
	}
	pub := &poisonPublisher{chain: c}
	// Watermill's poison queue does the catching; our publisher adds the
	// failure envelope and writes to the table or the poison topic.
	c.poison, _ = wmw.PoisonQueueWithFilter(pub, cmp.Or(cfg.Poison.Topic, "millrace_poison"), shouldPoison)
	s.chains[h.Name] = c
	return c, nil
}

// Config returns the handler's effective configuration.
func (c *Chain) Config() Config { return c.cfg }

// Handler returns the handler the chain was built for.
func (c *Chain) Handler() Handler { return c.spec }

// Middlewares returns the chain, outermost first, for
// router.AddConsumerHandler(...).AddMiddleware(chain.Middlewares()...).
// Do not add Watermill's Retry, PoisonQueue or CircuitBreaker around it:
// the chain has its own, and doc.go explains the order.
func (c *Chain) Middlewares() []message.HandlerMiddleware {
	mws := []message.HandlerMiddleware{
		c.observe,
		wmw.Recoverer, // a panic in the chain itself: nack, never lose the message
		c.poison,
		c.validate,
		c.retry,
	}
	if c.breaker != nil {
		mws = append(mws, c.breaker.middleware)
	}
	mws = append(mws, c.attempt)
	if *c.cfg.Inbox.Enabled || *c.cfg.OrderingGuard {
		mws = append(mws, c.transaction)
	}
	return append(mws, wmw.Recoverer) // a panic in the handler: a retryable error, the transaction rolls back
}

// Wrap returns h wrapped in the whole chain, for
// router.AddConsumerHandler(name, topic, subscriber, chain.Wrap(h)).
func (c *Chain) Wrap(h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	next := message.HandlerFunc(func(msg *message.Message) ([]*message.Message, error) {
		return nil, h(msg)
	})
	mws := c.Middlewares()
	for i := len(mws) - 1; i >= 0; i-- {
		next = mws[i](next)
	}
	return func(msg *message.Message) error {
		_, err := next(msg)
		return err
	}
}

// observe is the outermost stage: it gives the message its delivery state
// and counts the outcome.
func (c *Chain) observe(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d := &delivery{eventID: eventIDOf(msg)}
		orig := msg.Context()
		msg.SetContext(context.WithValue(orig, deliveryKey, d))
		out, err := h(msg)
		msg.SetContext(orig)
		outcome := cmp.Or(d.outcome, OutcomeOK)
		if err != nil {
			outcome = OutcomeNacked
			c.stack.logger.Info("Message returned to the broker for redelivery", c.logFields(d, watermill.LogFields{"reason": err.Error()}))
		}
		c.counter(outcome).Inc()
		return out, err
	}
}

// attempt bounds one attempt by handler_timeout. The attempt runs on a
// context that a shutdown does not cancel (context.WithoutCancel): work
// that started finishes and commits. Watermill's Timeout middleware is not
// used because it derives from the message's context and never restores it
// (Watermill issue #467).
func (c *Chain) attempt(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
		d := deliveryFrom(orig)
		d.attempts++
		ctx, cancel := context.WithTimeout(context.WithoutCancel(orig), c.cfg.HandlerTimeout)
		defer cancel()
		msg.SetContext(ctx)
		defer msg.SetContext(orig)
		start := time.Now()
		out, err := h(msg)
		c.timer.Observe(time.Since(start).Seconds())
		return out, err
	}
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

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
