package millracetest

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/middleware"
)

// TB is the part of testing.TB the harness uses. *testing.T, *testing.B and
// *testing.F satisfy it.
type TB interface {
	Helper()
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	Logf(format string, args ...any)
}

// Options configure a Harness.
type Options struct {
	// DB is the test database: the handler's business tables and millrace's
	// tables (New runs bus.Migrate on it). Required.
	DB *sql.DB
	// Schema is the PostgreSQL schema of millrace's tables. Defaults to
	// Config.Database.Schema, which defaults to "public".
	Schema string
	// Config is the service's millrace configuration. Its consumer section
	// (retry.max_attempts, inbox, ordering_guard, poison, the handler's
	// override under consumer.handlers) shapes the chain under test; its
	// outbox section checks the events. The broker, relay and metrics
	// sections are ignored: there is no broker. Defaults to config.yaml's
	// defaults.
	Config bus.Config
	// Topic is the topic the handler consumes. Required.
	Topic string
	// Name is the handler's name, as given to bus.Handle (the key of its
	// override under consumer.handlers). Defaults to Group.
	Name string
	// Group is the handler's consumer group: the inbox deduplicates per
	// group. Defaults to Name; one of the two is required.
	Group string
	// Handler is the handler under test. Required.
	Handler bus.HandlerFunc
	// RealTimings keeps the configured retry waits and breaker open timeout.
	// Defaults to false: the harness makes every retry wait 1ms and the
	// breaker's open timeout 10ms, so that a test does not sleep through
	// the retry ladder. Attempt counts, classification and everything else
	// stay as configured.
	RealTimings bool
	// Logger receives the chain's logs. Defaults to the test's log (t.Logf),
	// shown when a test fails or with go test -v.
	Logger *slog.Logger
}

// Short timings used unless Options.RealTimings.
const (
	shortRetryWait   = time.Millisecond
	shortBreakerOpen = 10 * time.Millisecond
)

// setupTimeout bounds the database work of New and of preparing events;
// deliveryTimeout bounds one delivery (attempts run on their own
// handler_timeout; this ends retry and breaker waits).
const (
	setupTimeout    = time.Minute
	deliveryTimeout = 2 * time.Minute
)

// maxNacks is how many times in a row the harness redelivers a nacked
// message before it reports the delivery as stuck.
const maxNacks = 5

// Harness runs one handler through millrace's consumer chain, on the test
// database, and drives deliveries to it in the patterns at-least-once
// delivery produces. It records every delivery for assertions. Call its
// methods from the test's goroutine, one at a time.
type Harness struct {
	t      TB
	db     *sql.DB
	cfg    bus.Config
	topic  string
	name   string
	group  string
	fn     bus.HandlerFunc
	logger *slog.Logger
	// events turns events into messages as the relay delivers them.
	events *bus.Bus
	// poisonTopic records what is poisoned when poison.destination is topic.
	poisonTopic *poisonRecorder

	mu        sync.Mutex
	current   *process
	processes int
	history   []Delivery
	delivered map[string]bus.Event // by id, as the handler receives them
}

// New migrates millrace's tables into the test database and returns a
// harness for opts.Handler, with its first consumer process started. A
// missing option, an invalid configuration or an unreachable database fails
// the test at once.
func New(t TB, opts Options) *Harness {
	t.Helper()
	var problems []string
	if opts.DB == nil {
		problems = append(problems, "Options.DB is required (the test database the handler writes to)")
	}
	if opts.Topic == "" {
		problems = append(problems, "Options.Topic is required (the topic the handler consumes)")
	}
	if opts.Name == "" && opts.Group == "" {
		problems = append(problems, "Options.Name or Options.Group is required (the handler's name, its consumer group)")
	}
	if opts.Handler == nil {
		problems = append(problems, "Options.Handler is required (the bus.HandlerFunc under test)")
	}
	if len(problems) > 0 {
		t.Fatalf("millracetest.New: %s", strings.Join(problems, "; "))
		return nil
	}
	h := &Harness{
		t:      t,
		db:     opts.DB,
		topic:  opts.Topic,
		name:   cmp.Or(opts.Name, opts.Group),
		group:  cmp.Or(opts.Group, opts.Name),
		fn:     opts.Handler,
		logger: opts.Logger,

		delivered: map[string]bus.Event{},
	}
	if h.logger == nil {
		h.logger = slog.New(slog.NewTextHandler(tbWriter{t}, nil))
	}
	cfg := withoutBroker(opts.Config)
	if opts.Schema != "" {
		cfg.Database.Schema = opts.Schema
	}
	cfg = cfg.WithDefaults()
	// Checked as given, before the timings change, so that the service's
	// own mistakes are reported.
	if err := cfg.Validate(); err != nil {
		t.Fatalf("millracetest.New: Options.Config: %v", err)
		return nil
	}
	if !opts.RealTimings {
		cfg.Consumer = shortTimings(cfg.Consumer, h.name)
	}
	h.cfg = cfg
	if cfg.Consumer.For(h.name).Poison.Destination == middleware.PoisonToTopic {
		h.poisonTopic = &poisonRecorder{}
	}

	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	if err := bus.Migrate(ctx, h.db, cfg); err != nil {
		t.Fatalf("millracetest.New: migrate millrace's tables: %v", err)
		return nil
	}
	b, err := bus.Open(ctx, cfg, h.db, bus.WithLogger(h.logger))
	if err != nil {
		t.Fatalf("millracetest.New: %v", err)
		return nil
	}
	h.events = b
	p, err := h.newProcess(ctx)
	if err != nil {
		t.Fatalf("millracetest.New: %v", err)
		return nil
	}
	h.current = p
	return h
}

// unusedBrokerURL fills broker.nats.url, which validation requires, in the
// harness's configuration; the harness never connects to a broker (the
// .invalid domain can never resolve).
const unusedBrokerURL = "nats://broker.millracetest.invalid:4222"

// withoutBroker clears the sections the harness does not use (broker,
// relay, metrics), so that their settings, or their absence, do not stop it.
func withoutBroker(c bus.Config) bus.Config {
	var zero bus.Config
	c.Broker, c.Relay, c.Metrics = zero.Broker, zero.Relay, zero.Metrics
	c.Broker.Kind = bus.KindNATS
	c.Broker.NATS.URL = unusedBrokerURL
	return c
}

// shortTimings makes the retry waits and the breaker's open timeout short,
// for handler name; other handlers' overrides are dropped (they do not
// apply to this handler, and shortened defaults could make them invalid).
func shortTimings(c middleware.Config, name string) middleware.Config {
	shorten := func(c *middleware.Config) {
		if c.Retry.InitialInterval != 0 {
			c.Retry.InitialInterval = shortRetryWait
		}
		if c.Retry.MaxInterval != 0 {
			c.Retry.MaxInterval = shortRetryWait
		}
		if c.Breaker.OpenTimeout != 0 {
			c.Breaker.OpenTimeout = shortBreakerOpen
		}
	}
	shorten(&c)
	override, ok := c.Handlers[name]
	c.Handlers = nil
	if ok {
		shorten(&override)
		c.Handlers = map[string]middleware.Config{name: override}
	}
	return c
}

// process is one consumer process: a chain of its own (its own breaker),
// its own metrics registry. A crash ends a process; the next delivery goes
// to a new one, as after a restart.
type process struct {
	id    int
	chain message.NoPublishHandlerFunc
	reg   *prometheus.Registry
	bus   *bus.Bus

	// Per delivery; a process handles one delivery at a time.
	runs       atomic.Int32 // handler calls
	crash      atomic.Bool  // end the process when the handler's first run returns
	failCommit atomic.Bool  // make the commit after the handler's first successful run fail
	crashed    atomic.Bool
}

// newProcess starts a consumer process: a Bus with its own registry and the
// chain bus.Run would build for the handler.
func (h *Harness) newProcess(ctx context.Context) (*process, error) {
	h.mu.Lock()
	h.processes++
	p := &process{id: h.processes, reg: prometheus.NewRegistry()}
	h.mu.Unlock()
	b, err := bus.Open(ctx, h.cfg, h.db, bus.WithRegistry(p.reg), bus.WithLogger(h.logger))
	if err != nil {
		return nil, err
	}
	p.bus = b
	var poison message.Publisher
	if h.poisonTopic != nil {
		poison = h.poisonTopic
	}
	p.chain, err = b.ConsumerChain(ctx, h.topic, h.name, h.handlerOf(p), poison, bus.WithConsumerGroup(h.group))
	if err != nil {
		return nil, err
	}
	return p, nil
}

// restart replaces the current process, which crashed, by a new one.
func (h *Harness) restart() {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	p, err := h.newProcess(ctx)
	if err != nil {
		h.t.Fatalf("millracetest: restart the consumer: %v", err)
		return
	}
	h.current.bus.Close()
	h.current = p
}

// injectedCommitFailure aborts the handler's transaction, so that
// PostgreSQL turns the chain's COMMIT into a ROLLBACK and the commit fails.
const injectedCommitFailure = `DO $$ BEGIN RAISE EXCEPTION 'millracetest: FailCommitOnce aborts this transaction so that its commit fails'; END $$`

// errInjectedCommitFailure stands in for a failed commit when the chain has
// no transaction (inbox and ordering guard both off).
var errInjectedCommitFailure = errors.New("millracetest: FailCommitOnce: the commit failed")

// handlerOf wraps the handler under test for process p: it counts the
// handler's runs and carries out the crash or commit failure a pattern asks for.
func (h *Harness) handlerOf(p *process) bus.HandlerFunc {
	return func(ctx context.Context, ev bus.Event) error {
		p.runs.Add(1)
		err := h.fn(ctx, ev)
		if p.crash.CompareAndSwap(true, false) {
			// The process dies here, inside the handler's transaction: the
			// goroutine ends without returning to the chain, whose deferred
			// rollback undoes the transaction as PostgreSQL does for a dead
			// connection; no retry runs, nothing is acked or nacked.
			p.crashed.Store(true)
			runtime.Goexit()
		}
		if err == nil && p.failCommit.CompareAndSwap(true, false) {
			tx := middleware.Tx(ctx) // nil with the inbox off, where bus.Tx panics
			if tx == nil {
				return errInjectedCommitFailure
			}
			_, _ = tx.ExecContext(ctx, injectedCommitFailure) // the error is the point: the commit will fail
		}
		return err
	}
}

// deliverOpts are what one delivery should do besides delivering.
type deliverOpts struct {
	crash      bool // the process dies when the handler's first run returns
	failCommit bool // the commit after the handler's first successful run fails
	loseAck    bool // the process dies after the chain returns: no ack or nack reaches the broker
}

// deliver hands msg to process p once, as a broker delivery, and records
// the result.
func (h *Harness) deliver(p *process, msg *message.Message, pattern, step string, o deliverOpts) Delivery {
	h.t.Helper()
	before := p.outcomes()
	p.runs.Store(0)
	p.crash.Store(o.crash)
	p.failCommit.Store(o.failCommit)
	p.crashed.Store(false)

	copyOf := msg.Copy()
	ctx, cancel := context.WithTimeout(context.Background(), deliveryTimeout)
	defer cancel()
	copyOf.SetContext(ctx)
	var err error
	returned := false
	done := make(chan struct{})
	go func() {
		defer close(done)
		err = p.chain(copyOf)
		returned = true
	}()
	<-done

	d := Delivery{
		EventID:     msg.UUID,
		Pattern:     pattern,
		Step:        step,
		Process:     p.id,
		HandlerRuns: int(p.runs.Load()),
	}
	after := p.outcomes()
	d.Retries = int(after[middleware.OutcomeRetried] - before[middleware.OutcomeRetried])
	switch {
	case !returned && p.crashed.Load():
		d.Outcome = OutcomeCrashed
	case !returned:
		// Errorf, not Fatalf: deliver may run on a goroutine of its own.
		h.t.Errorf("millracetest: the handler ended its goroutine while handling event %s (runtime.Goexit: t.FailNow or t.Fatal called in a handler?)", d.EventID)
		d.Outcome = "goroutine ended"
	default:
		d.Acked = err == nil && !o.loseAck
		if err != nil {
			d.Err = err.Error()
		}
		for _, o := range []string{middleware.OutcomeOK, middleware.OutcomeDuplicate, middleware.OutcomeStale, middleware.OutcomePoisoned, middleware.OutcomeNacked} {
			if after[o] > before[o] {
				d.Outcome = o
			}
		}
	}
	h.record(&d)
	return d
}

// record numbers d among the deliveries of its event and appends it.
func (h *Harness) record(d *Delivery) {
	h.mu.Lock()
	defer h.mu.Unlock()
	d.N = 1
	for _, prev := range h.history {
		if prev.EventID == d.EventID {
			d.N++
		}
	}
	h.history = append(h.history, *d)
}

// untilAcked delivers msg to the current process, again while it is nacked
// (a broker redelivers a nacked message), and fails the test if it stays
// nacked.
func (h *Harness) untilAcked(msg *message.Message, pattern, step string) {
	h.t.Helper()
	for range maxNacks {
		if d := h.deliver(h.current, msg, pattern, step, deliverOpts{}); d.Acked {
			return
		}
		step = "redelivered after a nack"
	}
	h.t.Errorf("millracetest: event %s was nacked %d times in a row; the chain never acked it:\n%s",
		msg.UUID, maxNacks, h.historyText(msg.UUID))
}

// outcomes reads the process's millrace_consumer_messages_total by outcome.
func (p *process) outcomes() map[string]float64 {
	out := map[string]float64{}
	families, _ := p.reg.Gather() // only millrace's own collectors: gathering cannot fail
	for _, f := range families {
		if f.GetName() != middleware.MetricMessages {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "outcome" {
					out[l.GetValue()] += m.GetCounter().GetValue()
				}
			}
		}
	}
	return out
}

// prepare publishes evs with bus.Publish in a transaction, reads them back
// from the outbox as the relay does, and rolls back: the messages are what
// the broker would deliver (envelope metadata, ids assigned), and the outbox
// keeps nothing. It returns the messages and the events as the handler
// receives them.
func (h *Harness) prepare(evs []bus.Event) ([]*message.Message, []bus.Event) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	tx, err := h.db.BeginTx(ctx, nil)
	if err != nil {
		h.t.Fatalf("millracetest: begin transaction: %v", err)
		return nil, nil
	}
	defer tx.Rollback() //nolint:errcheck // rolling back is the point
	if err := h.events.Publish(ctx, tx, h.topic, evs...); err != nil {
		h.t.Fatalf("millracetest: bus.Publish refused the events: %v", err)
		return nil, nil
	}
	payloads, err := store.Tables{Schema: h.cfg.Database.Schema, OutboxTopic: h.cfg.Outbox.Topic}.WrittenInTx(ctx, tx)
	if err != nil {
		h.t.Fatalf("millracetest: %v", err)
		return nil, nil
	}
	var msgs []*message.Message
	var events []bus.Event
	for _, payload := range payloads {
		_, msg, err := envelope.Unwrap(payload)
		if err != nil {
			h.t.Fatalf("millracetest: unwrap an outbox row: %v", err)
			return nil, nil
		}
		ev, err := bus.EventFromMessage(msg)
		if err != nil {
			h.t.Fatalf("millracetest: read event %s: %v", msg.UUID, err)
			return nil, nil
		}
		msgs = append(msgs, msg)
		events = append(events, ev)
	}
	if len(msgs) != len(evs) {
		h.t.Fatalf("millracetest: published %d events but read %d back from the outbox", len(evs), len(msgs))
		return nil, nil
	}
	h.mu.Lock()
	for _, ev := range events {
		h.delivered[ev.ID] = ev
	}
	h.mu.Unlock()
	return msgs, events
}

// prepareOne is prepare for one event.
func (h *Harness) prepareOne(ev bus.Event) (*message.Message, bus.Event) {
	h.t.Helper()
	msgs, events := h.prepare([]bus.Event{ev})
	if len(msgs) != 1 {
		return nil, bus.Event{}
	}
	return msgs[0], events[0]
}

// poisonRecorder is the poison publisher when poison.destination is topic:
// it keeps what was poisoned, by event id, for the assertions.
type poisonRecorder struct {
	mu      sync.Mutex
	reasons map[string]string
}

func (r *poisonRecorder) Publish(_ string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.reasons == nil {
		r.reasons = map[string]string{}
	}
	for _, m := range msgs {
		r.reasons[cmp.Or(m.Metadata.Get(bus.EventIDKey), m.UUID)] = m.Metadata.Get(middleware.PoisonReasonKey)
	}
	return nil
}

func (r *poisonRecorder) Close() error { return nil }

func (r *poisonRecorder) reason(eventID string) (string, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	reason, ok := r.reasons[eventID]
	return reason, ok
}

// tbWriter writes log lines to the test's log.
type tbWriter struct{ t TB }

func (w tbWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// Deliveries returns every delivery made so far, in order.
func (h *Harness) Deliveries() []Delivery {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]Delivery(nil), h.history...)
}

// deliveriesOf returns the deliveries of one event, in order.
func (h *Harness) deliveriesOf(eventID string) []Delivery {
	var out []Delivery
	for _, d := range h.Deliveries() {
		if d.EventID == eventID {
			out = append(out, d)
		}
	}
	return out
}

// Config returns the configuration the chain runs with: Options.Config with
// defaults applied, Options.Schema, and the short timings unless
// Options.RealTimings.
func (h *Harness) Config() bus.Config {
	c := h.cfg
	c.Consumer.Handlers = maps.Clone(c.Consumer.Handlers)
	return c
}

// historyText renders the deliveries of one event, one per line.
func (h *Harness) historyText(eventID string) string {
	var b strings.Builder
	for _, d := range h.deliveriesOf(eventID) {
		fmt.Fprintf(&b, "    %s\n", d)
	}
	return b.String()
}
