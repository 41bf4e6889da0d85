package forwarder

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/store"
)

// Broker is what the relay needs of a broker adapter.
type Broker interface {
	// PublishBatch publishes pipelined and returns nil only when every
	// message was confirmed, else an *adapters.BatchError.
	PublishBatch(ctx context.Context, msgs []adapters.Outgoing) error
	// Provision makes a destination topic exist before the first publish to it.
	Provision(ctx context.Context, topic string, consumerGroups ...string) error
}

// Outbox names the outbox the relay drains.
type Outbox struct {
	// Schema is the PostgreSQL schema of the outbox table (database.schema).
	Schema string
	// Topic is the watermill-sql topic of the outbox (outbox.topic).
	Topic string
}

// Options are the relay's optional collaborators.
type Options struct {
	// Logger defaults to no logging.
	Logger watermill.LoggerAdapter
	// Registerer receives the relay's Prometheus metrics. Defaults to none.
	Registerer prometheus.Registerer
	// TracerProvider receives a span per published message, continuing the
	// trace its publisher started. Defaults to OpenTelemetry's global one.
	TracerProvider trace.TracerProvider
	// Propagator reads a message's trace context from its metadata.
	// Defaults to OpenTelemetry's global propagator, or W3C trace context
	// and baggage when none is set.
	Propagator propagation.TextMapPropagator
}

// Forwarder is the relay from one outbox table to the broker.
type Forwarder struct {
	db      *sql.DB
	broker  Broker
	cfg     Config
	tables  store.Tables
	cursor  store.Cursor // the offsets row and shard this relay (or shard relay) reads
	logger  watermill.LoggerAdapter
	metrics *metrics
	limiter *rate.Limiter
	slice   int // messages per PublishBatch call

	provisioned map[string]bool
	backlog     backlog
	ahead       *ahead  // the next batch, read while the current one is published
	health      *health // shared by an instance's shard relays
	tracing     tracing

	// Test hooks, set only by this package's tests (see export_test.go).
	beforePublish func(batch int)
	afterPublish  func(batch int)
	// afterScheduledMove runs once due scheduled messages were committed
	// into the outbox.
	afterScheduledMove func(moved int)
}

// New returns a relay for outbox on db (a pool opened with pgx/v5's stdlib
// driver, which LISTEN/NOTIFY needs) that publishes to broker.
func New(db *sql.DB, broker Broker, outbox Outbox, cfg Config, opts Options) (*Forwarder, error) {
	cfg = cfg.WithDefaults()
	if errs := cfg.Validate("relay"); len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	if db == nil || broker == nil {
		return nil, errors.New("forwarder: db and broker are required")
	}
	tables := store.Tables{Schema: outbox.Schema, OutboxTopic: outbox.Topic}
	if err := tables.Validate(); err != nil {
		return nil, fmt.Errorf("forwarder: %w", err)
	}
	if opts.Logger == nil {
		opts.Logger = watermill.NopLogger{}
	}
	m, err := newMetrics(opts.Registerer, tables.OutboxNotifyPayload(), *cfg.Shards)
	if err != nil {
		return nil, fmt.Errorf("forwarder: register metrics: %w", err)
	}
	f := &Forwarder{
		db:          db,
		broker:      broker,
		cfg:         cfg,
		tables:      tables,
		cursor:      store.Cursor{Group: cfg.ConsumerGroup},
		health:      &health{},
		logger:      opts.Logger.With(watermill.LogFields{"outbox": tables.OutboxNotifyPayload()}),
		metrics:     m,
		slice:       cfg.MaxInFlight,
		provisioned: map[string]bool{},
		tracing:     newTracing(opts.TracerProvider, opts.Propagator),
	}
	if cfg.RateLimit > 0 {
		// Slices of a tenth of a second's worth keep a limited drain smooth.
		f.slice = max(1, min(cfg.MaxInFlight, cfg.RateLimit/10))
		f.limiter = rate.NewLimiter(rate.Limit(cfg.RateLimit), f.slice)
	}
	return f, nil
}

// errLeadershipLost stops the forwarding loop when the leader connection breaks.
var errLeadershipLost = errors.New("forwarder: lost the leader connection")

// ErrNotPgx is returned by Run when the pool's driver is not pgx/v5's stdlib
// driver, which LISTEN/NOTIFY needs; retrying cannot fix it.
var ErrNotPgx = errors.New("forwarder: LISTEN/NOTIFY needs a database/sql pool opened with pgx/v5's stdlib driver")

// Run forwards until ctx is cancelled. It first waits to become the active
// relay (a hot standby until then), then drains the outbox, waking on NOTIFY
// and on the fallback poll. Alongside, active or standby, it moves scheduled
// messages into the outbox when they are due. On cancellation the batch in flight gets up to
// shutdown_timeout to be confirmed and acked; otherwise it is abandoned
// unacked. Run returns nil after a clean stop, ErrNotPgx at once when the
// pool cannot LISTEN, and ErrShardsChanged at once when relay.shards differs
// from the count the outbox's pending rows were written with. With
// relay.shards > 1 the relay owns a share of the shards instead of waiting
// for the whole outbox (see shards.go).
func (f *Forwarder) Run(ctx context.Context) error {
	scheduleCtx, stopScheduling := context.WithCancel(ctx)
	var scheduling sync.WaitGroup
	defer func() { stopScheduling(); scheduling.Wait() }()
	scheduling.Go(func() { f.schedule(scheduleCtx) })
	retry := f.newBackoff()
	for ctx.Err() == nil {
		f.health.set(RoleStarting)
		err := f.start(ctx)
		f.health.set(RoleStarting)
		if ctx.Err() != nil {
			break
		}
		if errors.Is(err, ErrNotPgx) || errors.Is(err, ErrShardsChanged) {
			return err
		}
		wait := retry.NextBackOff()
		f.logger.Error("Relay lost leadership or could not connect; retrying", err, watermill.LogFields{"retry_in": wait.String()})
		if !sleep(ctx, wait) {
			break
		}
	}
	return nil
}

// lead takes the leader lock, then forwards until ctx ends or the lock's
// connection breaks.
func (f *Forwarder) lead(ctx context.Context) error {
	f.health.set(RoleStandby)
	conn, err := f.acquireLeadership(ctx)
	if err != nil {
		return err
	}
	defer discard(conn)
	f.health.set(RoleActive)
	f.metrics.leader.Set(1)
	f.metrics.shardOwned.WithLabelValues("0").Set(1)
	defer func() { f.metrics.leader.Set(0); f.metrics.shardOwned.WithLabelValues("0").Set(0) }()
	f.logger.Info("Relay is active", nil)

	if err := f.tables.PrepareOffsets(ctx, f.db, f.cursor); err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	listenCtx, stopListening := context.WithCancel(ctx)
	defer stopListening()
	wake := make(chan struct{}, 1)
	listenerDone := make(chan error, 1)
	ready := make(chan error, 1)
	go func() { listenerDone <- f.listen(listenCtx, conn, func(int) { signal(wake) }, ready) }()
	if err := <-ready; err != nil {
		return err
	}
	refresherDone := make(chan struct{})
	go func() { defer close(refresherDone); f.refreshBacklog(listenCtx) }()
	defer func() { stopListening(); <-refresherDone; f.dropAhead() }()
	// listenCtx ends with ctx or when lead returns, which also ends a read
	// ahead that forwardLoop left.
	return f.forwardLoop(listenCtx, wake, listenerDone)
}

// acquireLeadership blocks until this relay holds the outbox's session-level
// advisory lock. The lock lives as long as the returned connection; a
// crashed relay's connection closes and its standby takes over at once.
func (f *Forwarder) acquireLeadership(ctx context.Context) (*sql.Conn, error) {
	conn, err := f.db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("forwarder: leader connection: %w", err)
	}
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock(hashtextextended($1, 0))`, f.lockName()); err != nil {
		discard(conn)
		return nil, fmt.Errorf("forwarder: take leader lock: %w", err)
	}
	return conn, nil
}

func (f *Forwarder) lockName() string {
	return "millrace relay " + f.tables.OutboxNotifyPayload() + " " + f.cfg.ConsumerGroup
}

// discard closes conn's underlying connection instead of returning it to the
// pool, releasing any session lock and LISTEN it holds.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
	_ = conn.Close()
}

// signal wakes whoever waits on wake, unless a wake-up is already pending.
func signal(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}

// listen LISTENs on conn and calls notified for every notification naming
// this outbox, with the shard it names or -1 for all of them. It reports
// LISTEN's outcome on ready.
func (f *Forwarder) listen(ctx context.Context, conn *sql.Conn, notified func(shard int), ready chan<- error) error {
	err := conn.Raw(func(dc any) error {
		// *stdlib.Conn, or a driver that wraps it and exposes the same method.
		sc, ok := dc.(interface{ Conn() *pgx.Conn })
		if !ok {
			return fmt.Errorf("%w, got %T", ErrNotPgx, dc)
		}
		pc := sc.Conn()
		if _, err := pc.Exec(ctx, `LISTEN `+store.NotifyChannel); err != nil {
			return fmt.Errorf("forwarder: LISTEN: %w", err)
		}
		ready <- nil
		for {
			n, err := pc.WaitForNotification(ctx)
			if err != nil {
				return err
			}
			if shard, ours := f.tables.NotifiedShard(n.Payload); ours {
				notified(shard)
			}
		}
	})
	select {
	case ready <- err: // LISTEN itself failed
	default:
	}
	return err
}

// chaseFirst is the first quick re-poll. A committed row stays invisible to
// the batch query while any older transaction of the cluster is still open
// (the xid8 rule that keeps concurrent writers from being skipped), and its
// NOTIFY has already been spent; so after a notification, or when the batch
// query reports rows hidden that way, the relay polls again at 5ms, 10ms,
// 20ms, ... up to poll_interval.
const chaseFirst = 5 * time.Millisecond

// forwardLoop drains the outbox while this relay is the leader.
func (f *Forwarder) forwardLoop(ctx context.Context, wake <-chan struct{}, listenerDone <-chan error) error {
	retry := f.newBackoff()
	poll := time.NewTimer(0)
	defer poll.Stop()
	cleanup := time.NewTicker(f.cfg.CleanupInterval)
	defer cleanup.Stop()
	chase := time.Duration(0) // the next quick re-poll; 0 when not chasing
	for {
		f.health.beat()
		select {
		case <-ctx.Done():
			return nil
		case err := <-listenerDone:
			return fmt.Errorf("%w: %v", errLeadershipLost, err)
		case <-cleanup.C:
			f.cleanup(ctx)
			continue
		case <-wake:
			chase = chaseFirst
		case <-poll.C:
		}
		hidden := false
		for ctx.Err() == nil {
			n, h, err := f.forwardBatch(ctx)
			f.health.beat()
			if err != nil {
				f.metrics.publishErrors.WithLabelValues(errorClassRetryable).Inc()
				wait := retry.NextBackOff()
				f.logger.Error("Relay batch failed; backing off", err, watermill.LogFields{"retry_in": wait.String()})
				if !sleep(ctx, wait) {
					return nil
				}
				continue
			}
			retry.Reset()
			if n < f.cfg.BatchSize {
				hidden = h
				break // drained what is visible; wait for the next commit
			}
		}
		if hidden && chase == 0 {
			chase = chaseFirst
		}
		next := f.cfg.PollInterval
		if chase > 0 {
			next, chase = min(chase, next), chase*2
			if chase >= f.cfg.PollInterval {
				chase = 0
			}
		}
		poll.Reset(next)
	}
}

func (f *Forwarder) newBackoff() *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = f.cfg.RetryInitial
	b.MaxInterval = f.cfg.RetryMax
	b.RandomizationFactor = 0.5
	b.Multiplier = 2
	b.Reset()
	return b
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
