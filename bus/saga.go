package bus

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/middleware"
)

// Saga is an orchestration saga type: a long business process that does not
// fit in one transaction (order -> charge payment -> reserve stock ->
// notify, refunding when a later step fails). Its state S (a Go struct,
// stored as JSON) lives in a table of its own, one row per instance; events
// of typed topics start an instance (StartWith) or move one on (Then),
// found by a correlation id taken from the event (usually the aggregate
// id). A step runs in its handler's inbox transaction: it loads the state,
// the step changes it and sends commands (Publish or Schedule in Tx),
// and the state is saved with optimistic concurrency (a version column), so
// that the state change, the commands and the inbox mark commit together or
// not at all.
//
// Declare a saga once with NewSaga, add its steps, and register it with
// Handle; every declaration mistake is an error of Handle naming it.
type Saga[S any] struct {
	name      string
	steps     []sagaStep[S]
	errs      []error
	unmatched Unmatched
	retention time.Duration
}

// sagaStep is one event type a saga handles.
type sagaStep[S any] struct {
	start bool
	topic string
	typ   string
	route func(run func(ctx context.Context, id string, fn func(sc *SagaContext[S]) error) error) Route
	// correlate is the saga id an event of the step names, "" when it
	// names none (it does not decode, or correlate panics).
	correlate func(ev Event) string
}

// Unmatched is what a saga does with an event that finds no running
// instance: an event of a Then step when none was started, or any event of
// the saga once the instance has completed.
type Unmatched int

const (
	// IgnoreUnmatched acks the event and counts it in
	// millrace_saga_unmatched_total (the default): late replies and
	// timeouts of a completed saga are normal.
	IgnoreUnmatched Unmatched = iota
	// PoisonUnmatched poisons the event, to be looked at and replayed.
	PoisonUnmatched
)

// SagaOption changes how NewSaga declares a saga.
type SagaOption[S any] func(*Saga[S])

// WithUnmatched sets the Unmatched rule. Defaults to IgnoreUnmatched.
func WithUnmatched[S any](rule Unmatched) SagaOption[S] {
	return func(s *Saga[S]) { s.unmatched = rule }
}

// WithSagaRetention sets how long a completed saga's row is kept (for
// `millrace saga show` and late events) before bus.Run deletes it, every
// consumer.inbox.cleanup_interval. Defaults to 7 days.
func WithSagaRetention[S any](d time.Duration) SagaOption[S] {
	return func(s *Saga[S]) { s.retention = d }
}

// NewSaga declares the saga type name (stored with every instance: keep it
// stable) with state S.
func NewSaga[S any](name string, opts ...SagaOption[S]) *Saga[S] {
	s := &Saga[S]{name: name, retention: 7 * 24 * time.Hour}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Name is the saga type's name.
func (s *Saga[S]) Name() string { return s.name }

// SagaContext is what a step gets: the instance's state to change, and
// what it may do besides changing it. It is valid only during the step.
type SagaContext[S any] struct {
	// ID is the instance's correlation id.
	ID string
	// State is the instance's state, the zero S for an instance the step
	// starts. Change it in place; it is saved when the step returns nil.
	State *S
	// New is true when the step starts the instance.
	New bool

	b        *Bus
	tx       store.Execer
	timeouts map[string]string
	complete bool
}

// Complete marks the saga completed when the step commits: its pending
// timeouts are cancelled, later events for it follow the Unmatched rule,
// and its row is deleted after the saga's retention.
func (sc *SagaContext[S]) Complete() { sc.complete = true }

// ScheduleTimeout schedules ev on topic, due when, as the saga's timeout
// called name (one per name: scheduling name again cancels the previous
// one), in the step's transaction. Handle the timeout event with a Then
// step; cancel it with CancelTimeout when the awaited event arrives first.
// A timeout that was already due when it was cancelled may still arrive:
// its step should check the state.
func (sc *SagaContext[S]) ScheduleTimeout(ctx context.Context, name, topic string, when When, ev Event) error {
	if err := sc.CancelTimeout(ctx, name); err != nil {
		return err
	}
	ids, err := sc.b.Schedule(ctx, sc.tx, topic, when, ev)
	if err != nil {
		return err
	}
	sc.timeouts[name] = ids[0]
	return nil
}

// CancelTimeout cancels the pending timeout name, if any, in the step's
// transaction.
func (sc *SagaContext[S]) CancelTimeout(ctx context.Context, name string) error {
	id, ok := sc.timeouts[name]
	if !ok {
		return nil
	}
	delete(sc.timeouts, name)
	if err := sc.b.CancelScheduled(ctx, sc.tx, id); err != nil && !errors.Is(err, ErrNotScheduled) {
		return err
	}
	return nil
}

// Timeouts returns the pending timeouts' names.
func (sc *SagaContext[S]) Timeouts() []string {
	out := make([]string, 0, len(sc.timeouts))
	for n := range sc.timeouts {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// SagaStepFunc is a saga step: it changes sc.State and sends commands in
// the handler's transaction (Tx). It may run more than
// once for one event (after a version conflict, or a retry): it must do
// nothing outside that transaction. An error is handled as a handler's
// error (retried, or poisoned when permanent), and nothing of the step is
// kept.
type SagaStepFunc[S, T any] func(ctx context.Context, sc *SagaContext[S], m Message[T]) error

// StartWith adds a step that starts an instance: an event of t's type,
// correlated by correlate (the saga id it names, from the event's value or
// its envelope, such as m.AggregateID), creates the instance with the zero S (or, when
// the instance exists already, moves it on like a Then step). It returns
// s.
func StartWith[S, T any](s *Saga[S], t *Topic[T], correlate func(Message[T]) string, fn SagaStepFunc[S, T]) *Saga[S] {
	return addStep(s, true, t, correlate, fn)
}

// Then adds a step that moves a running instance on: an event of t's type,
// correlated by correlate. An event that finds no running instance follows
// the saga's Unmatched rule. Compensation steps (a refund after a failed
// reservation) are Then steps too. It returns s.
func Then[S, T any](s *Saga[S], t *Topic[T], correlate func(Message[T]) string, fn SagaStepFunc[S, T]) *Saga[S] {
	return addStep(s, false, t, correlate, fn)
}

func addStep[S, T any](s *Saga[S], start bool, t *Topic[T], correlate func(Message[T]) string, fn SagaStepFunc[S, T]) *Saga[S] {
	kind := "Then"
	if start {
		kind = "StartWith"
	}
	switch {
	case t == nil:
		s.errs = append(s.errs, fmt.Errorf("%s step for %v: the topic is nil", kind, reflect.TypeFor[T]()))
		return s
	case fn == nil:
		s.errs = append(s.errs, fmt.Errorf("%s step for event type %q: the step has no handler (its func is nil)", kind, t.typ.name))
	case correlate == nil:
		s.errs = append(s.errs, fmt.Errorf("%s step for event type %q: no correlation (its correlate func is nil)", kind, t.typ.name))
	}
	step := sagaStep[S]{start: start, topic: t.name, typ: t.typ.name, correlate: func(ev Event) (id string) {
		defer func() {
			if recover() != nil {
				id = "" // the step itself reports it, with the message
			}
		}()
		v, err := decodeEvent[T](t.typ, ev)
		if err != nil || correlate == nil {
			return ""
		}
		return correlate(Message[T]{Value: v, Event: ev})
	}}
	step.route = func(run func(ctx context.Context, id string, fn func(sc *SagaContext[S]) error) error) Route {
		return On(t, func(ctx context.Context, m Message[T]) error {
			id := correlate(m)
			if id == "" || names.Text(id) != nil {
				return Permanent(middleware.Invalid("payload", "saga %s: event type %s correlates to the saga id %q, which is empty or not text", s.name, t.typ.name, id))
			}
			return run(ctx, id, func(sc *SagaContext[S]) error { return fn(ctx, sc, m) })
		})
	}
	s.steps = append(s.steps, step)
	return s
}

// check returns every declaration error, each naming the step.
func (s *Saga[S]) check() error {
	errs := slices.Clone(s.errs)
	if err := names.Text(s.name); err != nil || s.name == "" {
		errs = append(errs, fmt.Errorf("saga name %q: must be non-empty text", s.name))
	}
	seen := map[string]bool{}
	starts := 0
	for _, st := range s.steps {
		if st.start {
			starts++
		}
		key := st.topic + " " + st.typ
		if seen[key] {
			what := "two steps"
			if st.start {
				what = "two starting steps"
			}
			errs = append(errs, fmt.Errorf("%s for event type %q on topic %q: an event starts or moves a saga in one way", what, st.typ, st.topic))
		}
		seen[key] = true
	}
	if len(s.steps) > 0 && starts == 0 {
		errs = append(errs, errors.New("no StartWith step: nothing would ever start an instance"))
	}
	if len(s.steps) == 0 && len(s.errs) == 0 {
		errs = append(errs, errors.New("no steps"))
	}
	if s.retention < 0 {
		errs = append(errs, fmt.Errorf("retention must not be negative; got %s", s.retention))
	}
	var zero S
	if _, err := json.Marshal(&zero); err != nil {
		errs = append(errs, fmt.Errorf("state %v does not encode as JSON: %w", reflect.TypeFor[S](), err))
	}
	if len(errs) > 0 {
		return fmt.Errorf("millrace: saga %q: %w", s.name, errors.Join(errs...))
	}
	return nil
}

// Routes checks the saga and returns its steps as typed routes, by topic:
// what Handle registers, one handler per topic. It is for code that drives
// deliveries itself (ConsumerChainTypes); a service uses Handle.
func (s *Saga[S]) Routes(b *Bus) (map[string][]Route, error) {
	if b == nil {
		return nil, fmt.Errorf("millrace: saga %q: the Bus is nil", s.name)
	}
	if err := s.check(); err != nil {
		return nil, err
	}
	unmatched, err := b.sagaUnmatchedCounter()
	if err != nil {
		return nil, err
	}
	routes := map[string][]Route{}
	for _, st := range s.steps {
		start, typ := st.start, st.typ
		routes[st.topic] = append(routes[st.topic], st.route(func(ctx context.Context, id string, fn func(sc *SagaContext[S]) error) error {
			err := b.runSagaStep(ctx, s.name, id, start, func(tx store.Execer, row *store.SagaRow, isNew bool) (bool, error) {
				row.Step = typ
				return s.step(ctx, b, tx, row, isNew, fn)
			})
			if err != nil && !errors.Is(err, errSagaUnmatched) && ctx.Err() == nil {
				b.recordSagaError(ctx, s.name, id, typ, err)
			}
			if errors.Is(err, errSagaUnmatched) {
				unmatched.WithLabelValues(s.name, typeLabel(typ)).Inc()
				if s.unmatched == PoisonUnmatched {
					return Permanent(fmt.Errorf("saga %s: event type %s for saga id %q: %w", s.name, typ, id, err))
				}
				b.logger.Info("Saga event matched no running instance; ignored", watermill.LogFields{"saga": s.name, "saga_id": id, "event_type": typ})
				return nil
			}
			return err
		}))
	}
	return routes, nil
}

// Handle registers the saga's handlers on b under name: one handler (and
// consumer group) per topic its steps read, called name when they read one
// topic and name.<topic> otherwise (Handlers lists them). Events of a
// topic's other types are acked (WithUnknownTypes(AckUnknown), the
// default) unless opts say otherwise. The handlers are ordered by the
// saga's correlation id: two events of one saga instance on one topic are
// handled one after the other, in the order the broker delivers them
// (consumer.ordered is true for them unless
// consumer.handlers.<handler>.ordered sets it).
func (s *Saga[S]) Handle(b *Bus, name string, opts ...HandleOption) error {
	routes, err := s.Routes(b)
	if err != nil {
		return err
	}
	handlers, topics := s.handlers(name)
	for i, topic := range topics {
		handler := handlers[i]
		if err := checkSagaBatch(b.cfg.Consumer, s.name, handler); err != nil {
			return err
		}
		if err := b.HandleTypes(handler, routes[topic], append(opts, s.ordering(topic))...); err != nil {
			return err
		}
	}
	b.mu.Lock()
	b.sagas = append(b.sagas, sagaRetention{name: s.name, retention: s.retention})
	b.mu.Unlock()
	return nil
}

// Handlers returns the names of the handlers Handle(b, name) registers, in
// the order it registers them: name when the saga's steps read one topic,
// name.<topic> for each topic (sorted) otherwise. They are the keys of the
// saga's overrides under consumer.handlers and, unless WithConsumerGroup
// says otherwise, its consumer groups, to provision or configure before
// the saga runs.
func (s *Saga[S]) Handlers(name string) []string {
	handlers, _ := s.handlers(name)
	return handlers
}

// handlers returns the handlers Handle(b, name) registers and the topic
// each reads, sorted by topic.
func (s *Saga[S]) handlers(name string) (handlers, topics []string) {
	for _, st := range s.steps {
		if !slices.Contains(topics, st.topic) {
			topics = append(topics, st.topic)
		}
	}
	slices.Sort(topics)
	handlers = make([]string, len(topics))
	for i, topic := range topics {
		handlers[i] = name
		if len(topics) > 1 {
			handlers[i] = name + "." + topic
		}
	}
	return handlers, topics
}

// ordering is the HandleOption of the saga's handler on topic: ordered
// unless its config says otherwise, by the saga id its events name (the
// aggregate for an event that names none).
func (s *Saga[S]) ordering(topic string) HandleOption {
	byType := map[string]func(Event) string{}
	for _, st := range s.steps {
		if st.topic == topic {
			byType[st.typ] = st.correlate
		}
	}
	return func(spec *handlerSpec) {
		spec.ordered = true
		spec.orderKey = func(msg *message.Message) string {
			correlate, ok := byType[msg.Metadata.Get(EventTypeKey)]
			if !ok {
				return ""
			}
			ev, err := EventFromMessage(msg)
			if err != nil {
				return ""
			}
			return correlate(ev)
		}
	}
}

// step runs fn on row's state and returns whether the saga completed.
func (s *Saga[S]) step(ctx context.Context, b *Bus, tx store.Execer, row *store.SagaRow, isNew bool, fn func(sc *SagaContext[S]) error) (bool, error) {
	state := new(S)
	if !isNew {
		if err := json.Unmarshal(row.State, state); err != nil {
			return false, Permanent(fmt.Errorf("saga %s %q: state does not decode into %v: %w", s.name, row.ID, reflect.TypeFor[S](), err))
		}
	}
	timeouts := map[string]string{}
	for k, v := range row.Timeouts {
		timeouts[k] = v
	}
	sc := &SagaContext[S]{ID: row.ID, State: state, New: isNew, b: b, tx: tx, timeouts: timeouts}
	if err := fn(sc); err != nil {
		return false, err
	}
	if sc.complete {
		for _, name := range sc.Timeouts() {
			if err := sc.CancelTimeout(ctx, name); err != nil {
				return false, err
			}
		}
	}
	data, err := json.Marshal(state)
	if err != nil {
		return false, Permanent(fmt.Errorf("saga %s %q: state does not encode: %w", s.name, row.ID, err))
	}
	row.State, row.Timeouts = data, sc.timeouts
	return sc.complete, nil
}

// MaxSagaBatchMessages bounds consumer.batch.max_messages for a saga's
// handlers, half of middleware.MaxBatchMessages: in a batch, a step runs in
// a savepoint of its own (the one its rerun after a version conflict rolls
// back to) inside its message's savepoint, so each message is two
// subtransactions that wrote, and PostgreSQL caches the ids of 64 per
// transaction.
const MaxSagaBatchMessages = middleware.MaxBatchMessages / 2

// checkSagaBatch refuses a saga handler whose batches would overflow
// PostgreSQL's subtransaction cache (see MaxSagaBatchMessages), naming the
// YAML path that sets the batch size.
func checkSagaBatch(c middleware.Config, saga, handler string) error {
	n := c.For(handler).Batch.MaxMessages
	if n <= MaxSagaBatchMessages {
		return nil
	}
	path := "consumer.batch.max_messages"
	if h, ok := c.Handlers[handler]; ok && h.Batch.MaxMessages != 0 {
		path = "consumer.handlers." + handler + ".batch.max_messages"
	}
	return &ConfigError{Problems: []error{&FieldError{Path: path, Problem: fmt.Sprintf(
		"must be at most %d for handler %s of saga %q (each message of a batch is two subtransactions); got %d",
		MaxSagaBatchMessages, handler, saga, n)}}}
}

// errSagaUnmatched: a Then step's event found no running instance.
var errSagaUnmatched = errors.New("no running saga instance")

// maxSagaConflicts bounds the in-transaction retries of a step after a
// version conflict; beyond it the attempt fails and is retried by the chain.
const maxSagaConflicts = 10

// runSagaStep loads instance id of saga in the handler's transaction, runs
// step on it and saves it. On a version conflict (another transaction saved
// the instance since it was loaded) it rolls back to a savepoint taken
// before the load, so that nothing of the step is kept, and runs it again
// on the instance as that transaction left it.
func (b *Bus) runSagaStep(ctx context.Context, saga, id string, start bool,
	step func(tx store.Execer, row *store.SagaRow, isNew bool) (completed bool, err error)) error {
	inbox := middleware.CurrentTx(ctx)
	var q store.RowQuerier
	switch tx := inbox.(type) {
	case *sql.Tx:
		q = sqlRowQuerier{DB: tx}
	case *pgxInboxTx:
		q = pgxRowQuerier{tx.tx}
	default:
		return Permanent(fmt.Errorf("saga %s: %w", saga, noTx(ctx, "a saga step")))
	}
	for attempt := 1; ; attempt++ {
		if _, err := inbox.ExecContext(ctx, `SAVEPOINT millrace_saga`); err != nil {
			return fmt.Errorf("saga %s %q: savepoint: %w", saga, id, err)
		}
		err := b.trySagaStep(ctx, q, inbox, saga, id, start, step)
		if !errors.Is(err, store.ErrSagaVersionConflict) || attempt == maxSagaConflicts {
			if err == nil {
				_, err = inbox.ExecContext(ctx, `RELEASE SAVEPOINT millrace_saga`)
			}
			return err
		}
		if _, err := inbox.ExecContext(ctx, `ROLLBACK TO SAVEPOINT millrace_saga`); err != nil {
			return fmt.Errorf("saga %s %q: roll back to savepoint: %w", saga, id, err)
		}
	}
}

func (b *Bus) trySagaStep(ctx context.Context, q store.RowQuerier, tx store.Execer, saga, id string, start bool,
	step func(tx store.Execer, row *store.SagaRow, isNew bool) (bool, error)) error {
	row, found, err := b.tables.LoadSaga(ctx, q, saga, id)
	if err != nil {
		return err
	}
	if (!found && !start) || !row.Completed.IsZero() {
		return errSagaUnmatched
	}
	completed, err := step(tx, &row, !found)
	if err != nil {
		return err
	}
	return b.tables.SaveSaga(ctx, tx, row, completed)
}

// sagaErrorWriteTimeout bounds recording a step's error: the write runs
// on a connection of its own while the step's transaction is still open.
const sagaErrorWriteTimeout = 2 * time.Second

// recordSagaError stores err as the last error of the saga instance, for
// `millrace saga show`. The step's transaction rolls back with the error,
// so the write is a statement of its own on the Bus's database, on a table
// no step's transaction touches (it cannot wait for a lock the batch
// holds); failing to record is logged, never the message's fault.
func (b *Bus) recordSagaError(ctx context.Context, saga, id, step string, err error) {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sagaErrorWriteTimeout)
	defer cancel()
	e := store.SagaError{Step: step, Message: err.Error(), FailedAt: time.Now()}
	if werr := b.tables.RecordSagaError(wctx, b.db, saga, id, e); werr != nil {
		b.logger.Error("Could not record a saga step's error", werr, watermill.LogFields{"saga": saga, "saga_id": id, "step": step})
	}
}

// sqlRowQuerier is a *sql.Tx or *sql.DB as a store.RowQuerier.
type sqlRowQuerier = store.SQLRowQuerier

type pgxRowQuerier struct{ tx pgx.Tx }

func (q pgxRowQuerier) QueryRow(ctx context.Context, query string, args ...any) store.Row {
	return pgxRow{q.tx.QueryRow(ctx, query, args...)}
}

// pgxRow is a pgx.Row whose "no rows" error is sql.ErrNoRows.
type pgxRow struct{ row pgx.Row }

func (r pgxRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return sql.ErrNoRows
	}
	return err
}

// sagaRetention is a registered saga's retention, for Run's cleanup.
type sagaRetention struct {
	name      string
	retention time.Duration
}

// sagaUnmatchedCounter registers millrace_saga_unmatched_total once.
func (b *Bus) sagaUnmatchedCounter() (*prometheus.CounterVec, error) {
	return b.sharedCounter(&b.sagaUnmatched, prometheus.CounterOpts{
		Name: MetricSagaUnmatched,
		Help: "Saga events that found no running instance (none started, or completed), by saga and event type; ignored or poisoned as the saga's Unmatched rule says.",
	}, "saga", "event_type")
}

// pruneSagas deletes completed sagas past their retention, and step errors
// older than it, every consumer.inbox.cleanup_interval until ctx ends.
func (b *Bus) pruneSagas(ctx context.Context, sagas []sagaRetention) error {
	return every(ctx, b.cfg.Consumer.Inbox.CleanupInterval, func() {
		for _, s := range sagas {
			for {
				n, err := b.tables.DeleteCompletedSagas(ctx, b.db, s.name, s.retention, 1000)
				if err != nil {
					if ctx.Err() == nil {
						b.logger.Error("Could not delete completed sagas", err, watermill.LogFields{"saga": s.name})
					}
					break
				}
				if n < 1000 {
					break
				}
			}
			if _, err := b.tables.DeleteSagaErrors(ctx, b.db, s.name, s.retention); err != nil && ctx.Err() == nil {
				b.logger.Error("Could not delete old saga errors", err, watermill.LogFields{"saga": s.name})
			}
		}
	})
}
