package bus

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// HandlerFunc processes one event. Returning nil acks it (after the inbox
// transaction commits); an error is retried with backoff, and poisoned when
// it is Permanent or retries run out. Do business writes in Tx so they
// commit with the inbox row; events published with
// Publish(ctx, Tx[Execer](ctx), ...)
// commit with them too and get this event as their causation.
type HandlerFunc func(ctx context.Context, ev Event) error

// HandleOption changes how Handle registers a handler.
type HandleOption func(*handlerSpec)

// WithConsumerGroup sets the handler's consumer group. Every group receives
// every event of the topic; instances of a service sharing a group share its
// events. The inbox deduplicates per group. Defaults to the handler name.
func WithConsumerGroup(group string) HandleOption {
	return func(s *handlerSpec) { s.group = group }
}

// WithDependencyProbe gives the handler a check of the dependencies it
// calls (a service's health endpoint, SELECT 1 on a database of its own):
// nil when they answer, an error when they do not. After a retryable
// failure the chain asks it before counting the attempt against the event:
// when the probe fails too, the failure is the dependency's, the attempt is
// not counted, and the handler's circuit breaker stays open, asking the
// probe once per consumer.breaker.open_timeout, until it passes, so an
// outage of any length poisons nothing; when it passes, the event is to
// blame and is poisoned after consumer.retry.max_attempts. It needs
// consumer.breaker.enabled (Run refuses the handler otherwise). See
// middleware.ProbeFunc.
func WithDependencyProbe(probe func(ctx context.Context) error) HandleOption {
	return func(s *handlerSpec) { s.probe = probe }
}

type handlerSpec struct {
	topic, name, group string
	fn                 HandlerFunc
	// batch, for a batch handler, is called instead of fn with the events
	// of a batch and how each arrived.
	batch func(ctx context.Context, evs []Event, arrivals []arrival) error
	// probe checks the handler's dependencies; nil for none.
	probe middleware.ProbeFunc
	// unknown is a typed handler's rule for event types it has no route for.
	unknown UnknownTypes
	// takes, when set, says which messages the handler takes (a typed
	// handler's event types); the chain acks the others (Handler.Takes).
	takes func(msg *message.Message) bool
	// orderKey, when set, is the key the handler is ordered by (a saga's
	// correlation id; Handler.OrderKey), and ordered makes the handler
	// ordered unless its consumer.handlers override says otherwise.
	orderKey func(msg *message.Message) string
	ordered  bool
}

// Handle registers fn to consume topic under the handler name name (the key
// of its overrides under consumer.handlers, a metric label, and by default
// its consumer group). Register every handler before Run. After Close it
// returns ErrClosed, as every registration does.
func (b *Bus) Handle(topic, name string, fn HandlerFunc, opts ...HandleOption) error {
	spec, errs := newHandlerSpec(handlerSpec{topic: topic, name: name, fn: fn}, opts)
	return b.register(spec, errs, "Handle")
}

// register adds spec to the handlers Run starts, or reports errs and the
// problems it finds, under the name of the registering call.
func (b *Bus) register(spec handlerSpec, errs []error, call string) error {
	topic, name := spec.topic, spec.name
	if len(errs) == 0 {
		if err := b.rules.CheckTopic(topic); err != nil {
			errs = append(errs, fmt.Errorf("topic on broker.kind %s: %w", b.cfg.Broker.Kind, err))
		} else if err := b.rules.CheckGroup(topic, spec.group); err != nil {
			errs = append(errs, fmt.Errorf("consumer group on broker.kind %s: %w", b.cfg.Broker.Kind, err))
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.checkOpen(); err != nil {
		return fmt.Errorf("millrace: %s(%q, %q): %w", call, topic, name, err)
	}
	if b.running {
		errs = append(errs, errors.New("Run has started; register handlers before it"))
	}
	for _, h := range b.handlers {
		if h.name == name {
			errs = append(errs, fmt.Errorf("handler %q is already registered", name))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("millrace: %s(%q, %q): %w", call, topic, name, errors.Join(errs...))
	}
	b.handlers = append(b.handlers, spec)
	return nil
}

// newHandlerSpec applies opts to spec and checks the names and the func.
func newHandlerSpec(spec handlerSpec, opts []HandleOption) (handlerSpec, []error) {
	topic, name := spec.topic, spec.name
	for _, o := range opts {
		o(&spec)
	}
	spec.group = cmp.Or(spec.group, name)
	var errs []error
	if err := names.Topic(topic); err != nil {
		errs = append(errs, fmt.Errorf("topic: %w", err))
	}
	if err := names.Topic(name); err != nil {
		errs = append(errs, fmt.Errorf("handler name: %w", err))
	}
	if err := names.Topic(spec.group); err != nil {
		errs = append(errs, fmt.Errorf("consumer group: %w", err))
	}
	if spec.fn == nil && spec.batch == nil {
		errs = append(errs, errors.New("handler func is nil"))
	}
	return spec, errs
}

// ConsumerChain returns fn wrapped exactly as Run wraps a handler registered
// with Handle(topic, name, fn, opts...): the consumer middleware chain of
// the consumer config (poison queue, retry, circuit breaker, inbox
// transaction, ordering guard) around millrace's envelope decoding, consumer
// span and causation of follow-up events. It needs no broker: the returned
// func processes one delivered message (an event as the relay publishes it)
// and returns nil when the broker should ack it, an error when the broker
// should deliver it again. poison receives poisoned messages when
// consumer.poison.destination is "topic"; it may be nil otherwise.
//
// Each call builds a chain on a middleware stack of its own, as a freshly
// started process would (its metrics go to the Bus's registry). It is for
// code that drives deliveries itself, such as package millracetest; a
// service uses Handle and Run.
func (b *Bus) ConsumerChain(ctx context.Context, topic, name string, fn HandlerFunc, poison message.Publisher, opts ...HandleOption) (message.NoPublishHandlerFunc, error) {
	spec, errs := newHandlerSpec(handlerSpec{topic: topic, name: name, fn: fn}, opts)
	if len(errs) > 0 {
		return nil, fmt.Errorf("millrace: ConsumerChain(%q, %q): %w", topic, name, errors.Join(errs...))
	}
	stack, err := b.consumerStack(ctx, poison, b.consumerConfig([]handlerSpec{spec}))
	if err != nil {
		return nil, err
	}
	_, handle, err := b.chain(stack, spec, nil)
	return handle, err
}

// Run connects to the broker and runs, until ctx ends (cancelled, or its
// deadline passed), the relay (unless relay.enabled is false) and every
// registered handler. It returns nil after such a graceful stop, whichever
// way ctx ended: the relay acks only what the broker confirmed, handlers
// finish or give back what they hold, nothing is poisoned by the stop. The
// stop is bounded: the relay's by relay.shutdown_timeout, the handlers' by
// the longest consumer handler_timeout plus 10s, even for a handler that
// ignores its context (its attempt is abandoned at handler_timeout and the
// message nacked; its goroutine may outlive Run).
//
// With handlers registered, every override under consumer.handlers must
// name one of them: a misspelt name is a *ConfigError listing the
// registered handlers, before anything connects. (A process that runs only
// the relay reads no consumer section.) Run may be called once, and not
// after Close (ErrClosed).
func (b *Bus) Run(ctx context.Context) error {
	handlers, sagas, err := b.start()
	if err != nil {
		return err
	}
	relayOn := *b.cfg.Relay.Enabled
	broker, err := connectBroker(ctx, b.cfg, b.logger) // b.cfg was validated by Open
	if err != nil {
		return err
	}
	defer broker.Close()

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	rs := &runState{broker: broker}
	// Handlers' topology is provisioned before the relay starts, so that no
	// event reaches a topic before this service's consumer groups exist on it
	// (RabbitMQ would park it rather than route it to their queues).
	var router *message.Router
	var stack *middleware.Stack
	if len(handlers) > 0 {
		if router, stack, rs.handlers, err = b.router(runCtx, broker, handlers); err != nil {
			return err
		}
		// Counted before the metrics are served: the first scrape has them.
		if err := stack.RefreshInboxRows(runCtx); err != nil {
			b.logger.Error("Could not count the inbox rows", err, nil)
		}
	}
	if relayOn {
		direct, err := b.openDirect()
		if err != nil {
			return err
		}
		if direct != nil {
			defer direct.Close()
		}
		rs.relay, err = forwarder.New(b.db, broker, forwarder.Outbox{Schema: b.cfg.Database.Schema, Topic: b.cfg.Outbox.Topic, BrokerKind: b.cfg.Broker.Kind},
			b.cfg.Relay, b.relayOptions(direct))
		if err != nil {
			return err
		}
	}
	b.run.Store(rs)
	defer b.run.Store(nil)
	if b.cfg.Metrics.Listen != "" {
		stopMetrics, err := b.serveMetrics(ctx)
		if err != nil {
			return err
		}
		defer stopMetrics()
	}

	var backlog *prometheus.GaugeVec
	if broker.Capabilities().Backlog && router != nil {
		if backlog, err = newBacklogMetric(b.registerer); err != nil {
			return err
		}
	}

	var wg sync.WaitGroup
	errs := make(chan error, 6)
	if rs.relay != nil {
		wg.Go(func() { errs <- rs.relay.Run(runCtx) })
	}
	if router != nil {
		wg.Go(func() { errs <- stack.RunRetention(runCtx) })
		wg.Go(func() { errs <- b.refreshInboxRows(runCtx, stack) })
		if len(sagas) > 0 {
			wg.Go(func() { errs <- b.pruneSagas(runCtx, sagas) })
		}
		if backlog != nil {
			wg.Go(func() { errs <- b.refreshBacklog(runCtx, broker, backlog, handlers) })
		}
		wg.Go(func() { errs <- router.Run(runCtx) })
	}
	go func() { wg.Wait(); close(errs) }()
	return firstFailure(ctx, errs, cancel)
}

// start marks the Bus running and returns what Run runs: the registered
// handlers and sagas, checked against the config.
func (b *Bus) start() ([]handlerSpec, []sagaRetention, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.running {
		return nil, nil, errors.New("millrace: Run was already called")
	}
	if err := b.checkOpen(); err != nil {
		return nil, nil, err
	}
	b.running = true
	handlers := append([]handlerSpec(nil), b.handlers...)
	sagas := append([]sagaRetention(nil), b.sagas...)
	if len(handlers) == 0 {
		if !*b.cfg.Relay.Enabled {
			return nil, nil, errors.New("millrace: nothing to run: relay.enabled is false and no handler is registered")
		}
		return nil, nil, nil
	}
	return handlers, sagas, checkOverrides(b.cfg.Consumer, handlers)
}

// firstFailure reads the results of Run's parts until every part has
// returned, and returns the first failure, cancelling the other parts at
// it. The stop is no failure: a cancellation, or ctx's deadline once it
// has passed.
func firstFailure(ctx context.Context, errs <-chan error, cancel context.CancelFunc) error {
	var first error
	for err := range errs {
		stopped := errors.Is(err, context.Canceled) || (ctx.Err() != nil && errors.Is(err, context.DeadlineExceeded))
		if err != nil && !stopped && first == nil {
			first = err
			cancel() // one part failed: stop the others
		}
	}
	return first
}

// checkOverrides refuses an override under consumer.handlers that names
// none of handlers: misspelt, it would leave its handler on the defaults
// without a word.
func checkOverrides(c middleware.Config, handlers []handlerSpec) error {
	registered := make([]string, len(handlers))
	for i, h := range handlers {
		registered[i] = h.name
	}
	slices.Sort(registered)
	var problems []error
	for _, name := range slices.Sorted(maps.Keys(c.Handlers)) {
		if !slices.Contains(registered, name) {
			problems = append(problems, &FieldError{Path: "consumer.handlers." + name, Problem: fmt.Sprintf(
				"no handler %q is registered; the registered handlers are %s", name, strings.Join(registered, ", "))})
		}
	}
	if len(problems) == 0 {
		return nil
	}
	return &ConfigError{Problems: problems}
}

// every calls fn every interval until ctx ends, and returns ctx's error.
func every(ctx context.Context, interval time.Duration, fn func()) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		fn()
	}
}

// refreshInboxRows counts the inbox rows every metrics.inbox_rows_interval
// until ctx ends.
func (b *Bus) refreshInboxRows(ctx context.Context, stack *middleware.Stack) error {
	return every(ctx, b.cfg.Metrics.InboxRowsInterval, func() {
		if err := stack.RefreshInboxRows(ctx); err != nil && ctx.Err() == nil {
			b.logger.Error("Could not count the inbox rows", err, nil)
		}
	})
}

// refreshBacklog sets millrace_consumer_backlog of every handler now and
// then every metrics.backlog_interval until ctx ends.
func (b *Bus) refreshBacklog(ctx context.Context, reporter adapters.Broker, gauge *prometheus.GaugeVec, handlers []handlerSpec) error {
	read := func() {
		for _, h := range handlers {
			partitions, err := reporter.Backlog(ctx, h.topic, h.group)
			if err != nil {
				if ctx.Err() == nil {
					b.logger.Error("Could not read a consumer group's backlog", err, watermill.LogFields{"handler": h.name, "topic": h.topic})
				}
				continue
			}
			for partition, n := range partitions {
				gauge.WithLabelValues(h.name, h.group, partition).Set(float64(n))
			}
		}
	}
	read()
	return every(ctx, b.cfg.Metrics.BacklogInterval, read)
}

// router builds the Watermill router with one chained handler per spec,
// each followed for the health checks.
func (b *Bus) router(ctx context.Context, broker adapters.Broker, handlers []handlerSpec) (*message.Router, *middleware.Stack, []*middleware.Chain, error) {
	cfg := b.consumerConfig(handlers)
	stack, err := b.consumerStack(ctx, broker.Publisher(), cfg)
	if err != nil {
		return nil, nil, nil, err
	}
	// On a stop every message in flight is settled within its handler's
	// handler_timeout (an attempt that has not returned by then is
	// abandoned), and each Dispatcher drains for at most handler_timeout +
	// 5s; the router's wait for its handlers is the backstop beyond that.
	longest := b.cfg.Consumer.HandlerTimeout
	for _, h := range handlers {
		longest = max(longest, b.cfg.Consumer.For(h.name).HandlerTimeout)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: longest + 10*time.Second}, routerLogger{b.logger})
	if err != nil {
		return nil, nil, nil, err
	}
	lag, err := newLagMetric(b.registerer)
	if err != nil {
		return nil, nil, nil, err
	}
	chains := make([]*middleware.Chain, 0, len(handlers))
	for _, h := range handlers {
		hc := cfg.For(h.name)
		group := adapters.GroupSpec{Name: h.group, Start: hc.Start, Ordered: *hc.Ordered}
		if err := broker.ProvisionGroup(ctx, h.topic, group); err != nil {
			return nil, nil, nil, fmt.Errorf("millrace: provision %s for handler %s: %w", h.topic, h.name, err)
		}
		chain, handle, err := b.chain(stack, h, lag.WithLabelValues(h.name, h.group))
		if err != nil {
			return nil, nil, nil, err
		}
		chains = append(chains, chain)
		sub := consumer.Subscriber(chain, consumer.BrokerSource(chain, broker, h.group))
		handler := router.AddConsumerHandler(h.name, h.topic, sub, handle)
		for _, m := range b.routerMiddleware {
			handler.AddMiddleware(m)
		}
	}
	slices.SortFunc(chains, func(x, y *middleware.Chain) int { return cmp.Compare(x.Handler().Name, y.Handler().Name) })
	return router, stack, chains, nil
}

// handlerErrorLine is the line Watermill's router logs when a handler
// returns an error, before it nacks the message.
const handlerErrorLine = "Handler returned error"

// routerLogger is the logger of Run's Watermill router: the chain logs
// each failed attempt, and each message it gives back to the broker, once
// with the handler, event id and attempt, so the router's own line for the
// same error is demoted to debug.
type routerLogger struct{ watermill.LoggerAdapter }

func (l routerLogger) Error(msg string, err error, fields watermill.LogFields) {
	if msg == handlerErrorLine {
		l.Debug(msg, fields.Add(watermill.LogFields{"error": err}))
		return
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l routerLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return routerLogger{l.LoggerAdapter.With(fields)}
}

// consumerConfig is the consumer section as handlers run with it: a handler
// registered as ordered by default (a saga's) is ordered unless its own
// override under consumer.handlers sets ordered.
func (b *Bus) consumerConfig(handlers []handlerSpec) middleware.Config {
	cfg := b.cfg.Consumer
	cfg.Handlers = maps.Clone(cfg.Handlers)
	for _, h := range handlers {
		if o := cfg.Handlers[h.name]; h.ordered && o.Ordered == nil {
			if cfg.Handlers == nil {
				cfg.Handlers = map[string]middleware.Config{}
			}
			o.Ordered = new(true)
			cfg.Handlers[h.name] = o
		}
	}
	return cfg
}

// consumerStack builds the middleware stack of the consumer config cfg and
// checks that its tables exist.
func (b *Bus) consumerStack(ctx context.Context, poison message.Publisher, cfg middleware.Config) (*middleware.Stack, error) {
	deps := middleware.Deps{
		DB: b.db, Schema: b.cfg.Database.Schema, PoisonPublisher: poison,
		Registerer: b.registerer, Logger: b.logger,
	}
	if b.pool != nil {
		deps.BeginTx = b.beginPgx
	}
	stack, err := middleware.New(cfg, deps)
	if err != nil {
		return nil, err
	}
	if err := stack.Check(ctx); err != nil {
		return nil, err
	}
	return stack, nil
}

// chain builds h's chain on stack and h's func wrapped in it: the one
// place Run and ConsumerChain build a handler. lag, when not nil, observes
// the lag of each message the chain processed.
//
// The handler is adapted first, so that the path from Handle to the chain
// leaves bus once: bus's part (decoding, span, causation) is all built
// before the chain is.
func (b *Bus) chain(stack *middleware.Stack, h handlerSpec, lag prometheus.Observer) (*middleware.Chain, message.NoPublishHandlerFunc, error) {
	var wrap func(*middleware.Chain) message.NoPublishHandlerFunc
	if h.batch != nil {
		fn := b.adaptBatch(h)
		wrap = func(c *middleware.Chain) message.NoPublishHandlerFunc { return c.WrapBatch(fn) }
	} else {
		fn := b.adapt(h)
		wrap = func(c *middleware.Chain) message.NoPublishHandlerFunc { return c.Wrap(fn) }
	}
	chain, err := stack.Chain(middleware.Handler{Name: h.name, Topic: h.topic, ConsumerGroup: h.group, Probe: h.probe,
		Takes: h.takes, OrderKey: h.orderKey, Lag: lag})
	if err != nil {
		return nil, nil, err
	}
	return chain, wrap(chain), nil
}

// adapt turns a HandlerFunc into the innermost Watermill handler: it decodes
// the envelope, continues the publisher's trace (and baggage) in a consumer
// span, and makes the event the causation of anything published while
// handling it.
func (b *Bus) adapt(h handlerSpec) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ev, err := EventFromMessage(msg)
		if err != nil {
			return Permanent(fmt.Errorf("invalid event envelope: %w", err))
		}
		ctx := forwarder.Propagator(b.propagator).Extract(msg.Context(), propagation.MapCarrier(msg.Metadata))
		ctx = context.WithValue(ctx, remoteSpanKey{}, trace.SpanContextFromContext(ctx))
		ctx, span := b.tracer.Start(ctx, h.topic+" process", trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithAttributes(
				attribute.String("messaging.operation.type", "process"),
				attribute.String("messaging.destination.name", h.topic),
				attribute.String("messaging.consumer.group.name", h.group),
				attribute.String("messaging.message.id", ev.ID),
				attribute.String("millrace.handler", h.name),
				attribute.String("millrace.event_type", ev.Type),
			))
		defer span.End()
		if err := callHandler(h.fn, context.WithValue(ctx, incomingKey{}, ev), ev); err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
			return err
		}
		return nil
	}
}

// callHandler calls fn; Tx panicking in it makes a permanent error.
func callHandler(fn HandlerFunc, ctx context.Context, ev Event) (err error) {
	defer noTxPanic(&err)
	return fn(ctx, ev)
}

// incomingKey carries the event being handled, for causation of follow-ups.
type incomingKey struct{}

func incomingEvent(ctx context.Context) (Event, bool) {
	ev, ok := ctx.Value(incomingKey{}).(Event)
	return ev, ok
}
