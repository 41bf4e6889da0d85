package forwarder

import (
	"cmp"
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/sleep"
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
	// BrokerKind is the broker.kind of the relay's broker. The relay
	// records it for the outbox at start (refusing a change while rows
	// are pending) and forwards no row that a service of another kind
	// wrote (Run returns ErrBrokerChanged). Empty: no check.
	BrokerKind string
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
	// Direct is a pool (pgx/v5's stdlib driver) on a connection to
	// PostgreSQL without a pooler in transaction mode between
	// (database.direct_url), on which the relay LISTENs. Defaults to the
	// relay's db; when notifications do not arrive through it, the relay
	// polls every poll_interval.
	Direct *sql.DB
	// ReplicationURL is the PostgreSQL URL of the replication connection
	// of a relay with relay.source: wal (database.direct_url, else
	// database.url: a pooler cannot carry replication). Unused otherwise.
	ReplicationURL string
}

// Forwarder is the relay from one outbox table to the broker.
type Forwarder struct {
	db       *sql.DB
	listenDB *sql.DB // where the relay LISTENs: Options.Direct, else db
	broker   Broker
	cfg      Config
	tables   store.Tables
	cursor   store.Cursor // the cursor this relay (or shard relay) forwards
	instance string       // this relay process's name in leases and the registry
	logger   watermill.LoggerAdapter
	metrics  *metrics
	limiter  *rate.Limiter
	slice    int // messages per PublishBatch call

	// lease and pos are the lease and position of the cursor while this
	// relay forwards it; saved is the position last recorded, at savedAt.
	// Only its forwarding loop reads and writes them.
	lease   store.Lease
	pos     store.Position
	saved   store.Position
	savedAt time.Time

	kind  string // broker.kind of broker, "" when unknown
	stamp []byte // store.BrokerStamp(kind): the metadata of the rows written for it

	provisioned   map[string]bool
	backlog       backlog
	ahead         *ahead        // the next batch, read while the current one is published
	health        *health       // shared by an instance's shard relays
	scheduledWake chan struct{} // a NOTIFY of a newly scheduled message
	tracing       tracing
	wal           *walSource // with relay.source: wal; nil otherwise

	// Test hooks, set only by this package's tests (see export_test.go).
	beforePublish func(batch int)
	afterPublish  func(batch int)
	// afterScheduledMove runs once due scheduled messages were committed
	// into the outbox.
	afterScheduledMove func(moved int)
}

// New returns a relay for outbox on db (a pool opened with pgx/v5's stdlib
// driver) that publishes to broker.
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
	m, err := newMetrics(opts.Registerer, tables.OutboxNotifyPayload(), cfg.OutboxShards())
	if err != nil {
		return nil, fmt.Errorf("forwarder: register metrics: %w", err)
	}
	instance := instanceID()
	f := &Forwarder{
		db:            db,
		listenDB:      cmp.Or(opts.Direct, db),
		broker:        broker,
		cfg:           cfg,
		tables:        tables.ForRelay(instance),
		kind:          outbox.BrokerKind,
		stamp:         store.BrokerStamp(outbox.BrokerKind),
		cursor:        store.Cursor{Group: cfg.ConsumerGroup},
		instance:      instance,
		health:        &health{},
		logger:        opts.Logger.With(watermill.LogFields{"outbox": tables.OutboxNotifyPayload()}),
		metrics:       m,
		slice:         cfg.MaxInFlight,
		provisioned:   map[string]bool{},
		scheduledWake: make(chan struct{}, 1),
		tracing:       newTracing(opts.TracerProvider, opts.Propagator),
	}
	if cfg.Source == SourceWAL {
		if f.wal, err = newWALSource(cfg, tables, opts.ReplicationURL, opts.Registerer); err != nil {
			return nil, err
		}
	}
	if cfg.RateLimit > 0 {
		// Slices of a tenth of a second's worth keep a limited drain smooth.
		f.slice = max(1, min(cfg.MaxInFlight, cfg.RateLimit/10))
		f.limiter = rate.NewLimiter(rate.Limit(cfg.RateLimit), f.slice)
	}
	return f, nil
}

// ErrNotPgx is returned by Run when the notification pool's driver is not
// pgx/v5's stdlib driver, which LISTEN needs; retrying cannot fix it.
var ErrNotPgx = errors.New("forwarder: LISTEN needs a database/sql pool opened with pgx/v5's stdlib driver")

// Run forwards until ctx is cancelled. It LISTENs for the outbox's
// notifications (or polls, when they do not arrive), waits to hold the
// lease of the outbox (a hot standby until then), then drains the outbox,
// waking on NOTIFY and on the fallback poll. Alongside, active or standby,
// it moves scheduled messages into the outbox when they are due. On
// cancellation the batch in flight gets up to shutdown_timeout to be
// confirmed and acked, otherwise it is abandoned unacked, and the lease is
// released. Run returns nil after a clean stop, ErrNotPgx at once when the
// notification pool cannot LISTEN, ErrShardsChanged at once when
// relay.shards differs from the count the outbox's pending rows were
// written with, and ErrBrokerChanged when the outbox holds rows for
// another broker.kind (at start, or at the first such row); with
// relay.source: wal, at once, an error naming the setting or statement
// the server or role misses, the slot's invalidation, or a slot dropped
// while the relay ran (see streamWAL).
// With relay.shards > 1 the relay holds the leases of a share of the
// shards instead of the whole outbox's (see shards.go).
func (f *Forwarder) Run(ctx context.Context) error {
	bgCtx, stopBackground := context.WithCancel(ctx)
	var background sync.WaitGroup
	defer func() { stopBackground(); background.Wait() }()
	background.Go(func() { f.schedule(bgCtx) })
	background.Go(func() { f.watchWaits(bgCtx) })
	if err := f.prepareWAL(ctx); err != nil {
		return err
	}
	retry := f.newBackoff()
	for ctx.Err() == nil {
		f.health.set(RoleStarting)
		err := f.start(ctx)
		f.health.set(RoleStarting)
		if ctx.Err() != nil {
			break
		}
		if errors.Is(err, ErrNotPgx) || errors.Is(err, ErrShardsChanged) || errors.Is(err, ErrBrokerChanged) || walFatal(err) {
			return err
		}
		wait := retry.NextBackOff()
		f.logger.Error("Relay lost its lease or could not connect; retrying", err, watermill.LogFields{"retry_in": wait.String()})
		if !sleep.For(ctx, wait) {
			break
		}
	}
	return nil
}

// errBadConn makes database/sql close a connection instead of pooling it.
var errBadConn = driver.ErrBadConn

// signal wakes whoever waits on wake, unless a wake-up is already pending.
func signal(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}

// forwardLoop drains the outbox while this relay holds the lease. lost is
// closed when the LISTEN connection ends (nil when polling).
func (f *Forwarder) forwardLoop(ctx context.Context, wake <-chan struct{}, lost <-chan struct{}) error {
	retry := f.newBackoff()
	poll := time.NewTimer(0)
	defer poll.Stop()
	cleanup := time.NewTicker(f.cfg.CleanupInterval)
	defer cleanup.Stop()
	flush := time.NewTimer(0)
	defer flush.Stop()
	for {
		f.health.beat()
		select {
		case <-ctx.Done():
			f.flushAtStop(ctx)
			return nil
		case <-lost:
			return fmt.Errorf("%w: the LISTEN connection ended", errLeadershipLost)
		case <-cleanup.C:
			f.cleanup(ctx)
			continue
		case <-flush.C:
			if err := f.flush(ctx); err != nil {
				f.logger.Error("Relay could not record its position; retrying with the next batch", err, nil)
				if errors.Is(err, store.ErrLeaseLost) {
					return fmt.Errorf("%w: %v", errLeadershipLost, err)
				}
			}
			continue
		case <-wake:
		case <-poll.C:
		}
		for ctx.Err() == nil {
			n, err := f.forwardBatch(ctx)
			f.health.beat()
			if errors.Is(err, store.ErrLeaseLost) {
				return fmt.Errorf("%w: %v", errLeadershipLost, err)
			}
			if errors.Is(err, ErrBrokerChanged) {
				f.flushAtStop(ctx)
				return err
			}
			if err != nil {
				f.metrics.publishErrors.WithLabelValues(errorClassRetryable).Inc()
				wait := retry.NextBackOff()
				f.logger.Error("Relay batch failed; backing off", err, watermill.LogFields{"retry_in": wait.String()})
				if !sleep.For(ctx, wait) {
					return nil
				}
				continue
			}
			retry.Reset()
			if n < f.cfg.BatchSize {
				break // drained; wait for the next commit
			}
		}
		if !f.pos.Equal(f.saved) {
			flush.Reset(max(0, positionEvery-time.Since(f.savedAt)))
		}
		poll.Reset(f.cfg.PollInterval)
	}
}

// flushAtStop records the position once the loop stops (cancelled, or
// refusing a row of another broker.kind): what was
// forwarded is not sent again, and counts as pending for no broker.
func (f *Forwarder) flushAtStop(ctx context.Context) {
	if err := f.flush(ctx); err != nil {
		f.logger.Error("Relay could not record its position at stop; the next relay sends its last rows again", err, nil)
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
