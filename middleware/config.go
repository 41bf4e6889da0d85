package middleware

import (
	"cmp"
	"reflect"
	"sort"
	"time"

	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/groupstart"
	"github.com/millrace-io/millrace/internal/names"
)

// Poison destinations accepted by poison.destination.
const (
	// PoisonToTable stores poisoned messages in the millrace_poison table of
	// the database (the default): listing and replay work the same on every broker.
	PoisonToTable = "table"
	// PoisonToTopic publishes poisoned messages to poison.topic through the
	// Deps.PoisonPublisher the caller supplies.
	PoisonToTopic = "topic"
)

// Config is the consumer section of config.yaml: how every handler's chain
// behaves, plus per-handler overrides. Each field's comment gives its default.
//
// An override in Handlers changes only the fields it sets; every field it
// leaves unset (zero, or absent from the YAML) keeps the value of the section
// above it. Booleans are pointers so that an override can set them to false.
type Config struct {
	// Workers is how many messages of one handler are processed at once in
	// this process. Defaults to 8. See README.md for what each broker allows.
	Workers int `yaml:"workers"`
	// Prefetch is how many messages of one handler the dispatcher holds at
	// most (in flight plus waiting for their aggregate's turn); at least
	// Workers. Defaults to twice Workers.
	Prefetch int `yaml:"prefetch"`
	// Ordered keeps the events of one aggregate (the aggregate-id header) in
	// order: the next is started only after the previous was acked. Defaults
	// to false (true for a saga's handlers, see bus.Saga.Handle).
	Ordered *bool `yaml:"ordered"`
	// Start is where the handler's consumer group starts reading its topic
	// when the group does not exist yet: adapters.StartNew ("new": the
	// events published from the moment bus.Run first provisions the group)
	// or adapters.StartAll ("all": every event the topic still holds, then
	// the new ones; not on RabbitMQ, whose queues keep no history). A group
	// that exists keeps its position whatever Start says. Defaults to
	// "new".
	Start groupstart.Start `yaml:"start"`
	// OrderingGuard drops (acks and counts as stale) an event whose
	// aggregate-version is not newer than the version this consumer group
	// already applied for its aggregate, inside the inbox transaction.
	// Defaults to false.
	OrderingGuard *bool `yaml:"ordering_guard"`
	// HandlerTimeout bounds one attempt: the inbox transaction, the handler
	// and the commit. At the timeout the attempt's context ends, and an
	// attempt that has not returned is abandoned: it counts as a failed
	// attempt (retried, then poisoned like any other failure), its
	// transaction is rolled back, its worker is freed and its goroutine is
	// left to finish. A stop waits for a running attempt at most this long.
	// Defaults to 30s.
	HandlerTimeout time.Duration `yaml:"handler_timeout"`
	// MaxMetadataBytes is the largest total size of a consumed message's
	// metadata keys and values; a bigger one is poisoned. Defaults to 16384.
	MaxMetadataBytes int `yaml:"max_metadata_bytes"`
	// Retry is the backoff between attempts of a failing message.
	Retry RetryConfig `yaml:"retry"`
	// Breaker is the per-handler circuit breaker.
	Breaker BreakerConfig `yaml:"breaker"`
	// Poison says where messages that cannot be processed go.
	Poison PoisonConfig `yaml:"poison"`
	// Inbox is the deduplication table written in the handler's transaction.
	Inbox InboxConfig `yaml:"inbox"`
	// Batch groups the inbox transactions of messages in flight into one
	// database transaction (group commit).
	Batch BatchConfig `yaml:"batch"`
	// Handlers holds per-handler overrides, keyed by handler name. An
	// override may not itself have handlers, nor the table-wide
	// inbox.retention, inbox.cleanup_interval and inbox.cleanup_batch.
	Handlers map[string]Config `yaml:"handlers"`
}

// RetryConfig is the exponential backoff with jitter between attempts.
type RetryConfig struct {
	// MaxAttempts is how many times a message is tried before it is
	// poisoned, the first try included. Defaults to 5.
	MaxAttempts int `yaml:"max_attempts"`
	// InitialInterval is the wait after the first failure. Defaults to 100ms.
	InitialInterval time.Duration `yaml:"initial_interval"`
	// Multiplier scales the wait after each further failure. Defaults to 2.
	Multiplier float64 `yaml:"multiplier"`
	// MaxInterval caps one wait. Defaults to 10s.
	MaxInterval time.Duration `yaml:"max_interval"`
	// MaxElapsed caps the time one message spends in attempts and waits
	// (time held by an open breaker does not count). Defaults to 1m.
	MaxElapsed time.Duration `yaml:"max_elapsed"`
	// Jitter spreads each wait uniformly over ±50% so that consumers that
	// failed together do not retry together. Defaults to true.
	Jitter *bool `yaml:"jitter"`
	// Mode says who waits between attempts: RetryAuto (the broker, when it
	// schedules redeliveries and the handler is unordered; in process
	// otherwise) or RetryInProcess (always the worker). Defaults to RetryAuto.
	Mode string `yaml:"mode"`
}

// Retry modes accepted by retry.mode.
const (
	// RetryAuto hands the waits of an unordered handler to a broker that
	// schedules redeliveries (adapters.Capabilities.ScheduledRedelivery:
	// NATS JetStream, RabbitMQ, Kafka with retry topics), freeing the
	// worker; the attempt number is then the broker's delivery
	// count and retry.max_elapsed is not applied. Elsewhere the worker waits.
	RetryAuto = "auto"
	// RetryInProcess always waits in the worker, within one delivery.
	RetryInProcess = "process"
)

// BreakerConfig configures the per-handler circuit breaker (sony/gobreaker).
type BreakerConfig struct {
	// Enabled turns the breaker on. Defaults to true.
	Enabled *bool `yaml:"enabled"`
	// ConsecutiveFailures is how many different messages must fail their
	// first attempt, with no attempt of the handler succeeding since, to
	// open the breaker. A message's later failures (retries, attempts
	// abandoned again at handler_timeout) do not count: they say nothing
	// new about the dependency. Defaults to 5.
	ConsecutiveFailures int `yaml:"consecutive_failures"`
	// OpenTimeout is how long the breaker stays open before it lets trial
	// attempts through (half-open). Defaults to 10s.
	OpenTimeout time.Duration `yaml:"open_timeout"`
	// HalfOpenRequests is how many trial attempts run while half-open; that
	// many successes close the breaker, one failure reopens it. Defaults to 1.
	HalfOpenRequests int `yaml:"half_open_requests"`
}

// PoisonConfig says where poisoned messages go.
type PoisonConfig struct {
	// Destination is "table" (the millrace_poison table) or "topic" (a broker
	// topic through Deps.PoisonPublisher). Defaults to "table".
	Destination string `yaml:"destination"`
	// Topic is the poison topic when Destination is "topic". Required then.
	Topic string `yaml:"topic"`
	// Park, for an ordered handler, parks the order key (aggregate) of a
	// poisoned message: the key's later messages are recorded in the
	// parked table and acked, not handled, until the poisoned message is
	// replayed (they follow it, in order) or skipped (they flow on
	// without it); see doc.go. It needs destination "table" and is
	// ignored for unordered handlers. False keeps the later messages
	// flowing past the poisoned one. Defaults to true for ordered
	// handlers with destination "table".
	Park *bool `yaml:"park"`
}

// Parks reports whether a handler with configuration c parks the order
// key of a poisoned message (PoisonConfig.Park).
func (c Config) Parks() bool {
	if c.Ordered == nil || !*c.Ordered || c.Poison.Destination != PoisonToTable {
		return false
	}
	return c.Poison.Park == nil || *c.Poison.Park
}

// InboxConfig configures the inbox (deduplication) table.
type InboxConfig struct {
	// Enabled records every processed event id in the handler's transaction
	// and acks a duplicate without calling the handler. Defaults to true.
	Enabled *bool `yaml:"enabled"`
	// Retention is how long an inbox row is kept. It must be longer than the
	// longest time a duplicate can still arrive: broker retention plus the
	// retry ladder plus any replay window (see README.md). Defaults to 720h (30 days).
	Retention time.Duration `yaml:"retention"`
	// CleanupInterval is how often RunRetention deletes expired rows. Defaults to 1h.
	CleanupInterval time.Duration `yaml:"cleanup_interval"`
	// CleanupBatch is how many rows one DELETE removes at most, so that the
	// cleanup never holds long locks. Defaults to 10000.
	CleanupBatch int `yaml:"cleanup_batch"`
}

// BatchConfig groups the inbox transactions of the messages a handler has in
// flight: up to MaxMessages of them run in one database transaction, each in
// a savepoint of its own (inbox insert, ordering guard, handler), with one
// COMMIT for all. A message whose handler fails or panics rolls back only
// its savepoint and is retried or poisoned as usual; the others commit; each
// message is acked only after the COMMIT that holds its effect. It applies
// when the inbox or the ordering guard is on.
type BatchConfig struct {
	// MaxMessages is the most messages in one transaction; 1 gives every
	// message a transaction of its own. A batch is made of messages in
	// flight, so workers (and, for an ordered handler on one subscription,
	// 1) caps it too. At most MaxBatchMessages. Defaults to
	// DefaultBatchMaxMessages.
	MaxMessages int `yaml:"max_messages"`
	// MaxWait is how long a batch waits, from its first message, for more
	// before it runs with what it has: the most a message at a trickle
	// waits. Less than handler_timeout. Defaults to DefaultBatchMaxWait.
	MaxWait time.Duration `yaml:"max_wait"`
}

// Default values, the ones config.yaml documents.
const (
	DefaultWorkers             = 8
	DefaultHandlerTimeout      = 30 * time.Second
	DefaultMaxMetadataBytes    = 16384
	DefaultMaxAttempts         = 5
	DefaultInitialInterval     = 100 * time.Millisecond
	DefaultMultiplier          = 2.0
	DefaultMaxInterval         = 10 * time.Second
	DefaultMaxElapsed          = time.Minute
	DefaultConsecutiveFailures = 5
	DefaultOpenTimeout         = 10 * time.Second
	DefaultInboxRetention      = 30 * 24 * time.Hour
	DefaultCleanupInterval     = time.Hour
	DefaultCleanupBatch        = 10000
	// DefaultBatchMaxMessages is 1, batching off, as measured: a batch runs
	// its messages one after another on one connection, so it saves COMMITs
	// (and BEGINs) at the price of the parallelism of separate transactions,
	// and a batch can only hold messages in flight. On the 2-core test
	// machine, whose local PostgreSQL commits about as fast as it runs a
	// statement (~0.4ms), BenchmarkConsumerThroughput ran batches of 8 (with
	// 8 workers: 2-4 messages per transaction) at 0.5-1.6x the batch-size-1
	// chain, and still at 0.6-0.8x with a COMMIT made 2ms slower; 32 workers
	// with batches of 32 (~11 per transaction; ~2.4 on Kafka, one message in
	// flight per partition) reached 0.8-2.0x, and 0.7-2.4x with the slow
	// COMMIT. So batching pays only with many more messages in
	// flight than transactions and a COMMIT that waits for a flush or a
	// synchronous standby: raise workers and max_messages together there.
	DefaultBatchMaxMessages = 1
	// DefaultBatchMaxWait is a few milliseconds: above the time the brokers
	// take to hand over the next messages once a batch is acked (under 1ms
	// locally), so that batches fill under load, and small beside a COMMIT
	// that waits for a flush. At a trickle a batch holding every message in
	// flight runs without waiting at all.
	DefaultBatchMaxWait = 2 * time.Millisecond
	// MaxBatchMessages bounds batch.max_messages: each message of a batch is
	// a subtransaction (its savepoint), and PostgreSQL keeps the ids of at
	// most 64 per transaction in shared memory; beyond that every snapshot
	// taken meanwhile, by any session, has to look them up (subxid overflow).
	MaxBatchMessages = 64
)

// WithDefaults returns c with every unset field at its default. Handler
// overrides are left as they are: For merges one onto the defaults.
func (c Config) WithDefaults() Config {
	c.Workers = cmp.Or(c.Workers, DefaultWorkers)
	c.Ordered = orDefault(c.Ordered, false)
	c.Start = cmp.Or(c.Start, groupstart.New)
	c.OrderingGuard = orDefault(c.OrderingGuard, false)
	c.HandlerTimeout = cmp.Or(c.HandlerTimeout, DefaultHandlerTimeout)
	c.MaxMetadataBytes = cmp.Or(c.MaxMetadataBytes, DefaultMaxMetadataBytes)

	c.Retry.MaxAttempts = cmp.Or(c.Retry.MaxAttempts, DefaultMaxAttempts)
	c.Retry.InitialInterval = cmp.Or(c.Retry.InitialInterval, DefaultInitialInterval)
	c.Retry.Multiplier = cmp.Or(c.Retry.Multiplier, DefaultMultiplier)
	c.Retry.MaxInterval = cmp.Or(c.Retry.MaxInterval, DefaultMaxInterval)
	c.Retry.MaxElapsed = cmp.Or(c.Retry.MaxElapsed, DefaultMaxElapsed)
	c.Retry.Jitter = orDefault(c.Retry.Jitter, true)
	c.Retry.Mode = cmp.Or(c.Retry.Mode, RetryAuto)

	c.Breaker.Enabled = orDefault(c.Breaker.Enabled, true)
	c.Breaker.ConsecutiveFailures = cmp.Or(c.Breaker.ConsecutiveFailures, DefaultConsecutiveFailures)
	c.Breaker.OpenTimeout = cmp.Or(c.Breaker.OpenTimeout, DefaultOpenTimeout)
	c.Breaker.HalfOpenRequests = cmp.Or(c.Breaker.HalfOpenRequests, 1)

	c.Poison.Destination = cmp.Or(c.Poison.Destination, PoisonToTable)

	c.Inbox.Enabled = orDefault(c.Inbox.Enabled, true)
	c.Inbox.Retention = cmp.Or(c.Inbox.Retention, DefaultInboxRetention)
	c.Inbox.CleanupInterval = cmp.Or(c.Inbox.CleanupInterval, DefaultCleanupInterval)
	c.Inbox.CleanupBatch = cmp.Or(c.Inbox.CleanupBatch, DefaultCleanupBatch)

	c.Batch.MaxMessages = cmp.Or(c.Batch.MaxMessages, DefaultBatchMaxMessages)
	c.Batch.MaxWait = cmp.Or(c.Batch.MaxWait, DefaultBatchMaxWait)
	return c
}

func orDefault(p *bool, def bool) *bool {
	if p != nil {
		return p
	}
	return &def
}

// For returns the configuration of handler: c (defaults applied) with the
// fields set in c.Handlers[handler] replacing the defaults, one field at a
// time. The result has no Handlers.
func (c Config) For(handler string) Config {
	base := c.WithDefaults()
	override, ok := base.Handlers[handler]
	base.Handlers = nil
	if !ok {
		return base
	}
	mergeSet(reflect.ValueOf(&base).Elem(), reflect.ValueOf(override))
	return base
}

// mergeSet copies every non-zero field of src onto dst, descending into
// structs, so an override replaces exactly the fields it sets. (Reflection
// keeps this in step with the struct definitions as fields are added.)
func mergeSet(dst, src reflect.Value) {
	for i := 0; i < src.NumField(); i++ {
		f := src.Field(i)
		switch {
		case src.Type().Field(i).Name == "Handlers":
		case f.Kind() == reflect.Struct:
			mergeSet(dst.Field(i), f)
		case !f.IsZero():
			dst.Field(i).Set(f)
		}
	}
}

// EffectivePrefetch is Prefetch, or twice Workers when Prefetch is unset.
func (c Config) EffectivePrefetch() int {
	if c.Prefetch > 0 {
		return c.Prefetch
	}
	return 2 * c.Workers
}

// Validate returns every problem in c, each a *confload.FieldError naming its
// YAML path under path (e.g. "consumer.retry.max_attempts"). Call it on a
// Config that has had WithDefaults applied. Each handler override is checked
// as merged onto the defaults, under path.handlers.<name>.
func (c Config) Validate(path string) []error {
	var chk confload.Checker
	c.validateHandler(&chk, path)
	chk.Positive(confload.Join(path, "inbox.cleanup_batch"), c.Inbox.CleanupBatch)
	chk.PositiveDuration(confload.Join(path, "inbox.retention"), c.Inbox.Retention)
	chk.PositiveDuration(confload.Join(path, "inbox.cleanup_interval"), c.Inbox.CleanupInterval)
	if len(chk.Problems) > 0 {
		// Overrides are checked merged onto valid defaults only, so that a
		// problem of the defaults is reported once, at its own path.
		return chk.Problems
	}
	handlers := make([]string, 0, len(c.Handlers))
	for name := range c.Handlers {
		handlers = append(handlers, name)
	}
	sort.Strings(handlers)
	for _, name := range handlers {
		hpath := confload.Join(path, "handlers."+name)
		o := c.Handlers[name]
		if err := names.Topic(name); err != nil {
			chk.Add(hpath, "not a handler name: %v", err)
		}
		if len(o.Handlers) > 0 {
			chk.Add(confload.Join(hpath, "handlers"), "an override cannot have handlers of its own")
		}
		for _, tw := range []struct {
			field string
			set   bool
		}{
			{"inbox.retention", o.Inbox.Retention != 0},
			{"inbox.cleanup_interval", o.Inbox.CleanupInterval != 0},
			{"inbox.cleanup_batch", o.Inbox.CleanupBatch != 0},
		} {
			if tw.set {
				chk.Add(confload.Join(hpath, tw.field), "applies to the whole inbox table; set it under %s", confload.Join(path, "inbox"))
			}
		}
		merged := c.For(name)
		merged.validateHandler(&chk, hpath)
	}
	return chk.Problems
}

// validateHandler checks the fields that may differ per handler.
func (c Config) validateHandler(chk *confload.Checker, path string) {
	at := func(field string) string { return confload.Join(path, field) }
	chk.Positive(at("workers"), c.Workers)
	chk.OneOf(at("start"), string(c.Start), string(groupstart.New), string(groupstart.All))
	if c.Prefetch < 0 || (c.Prefetch > 0 && c.Prefetch < c.Workers) {
		chk.Add(at("prefetch"), "must be at least workers (%d); got %d", c.Workers, c.Prefetch)
	}
	chk.PositiveDuration(at("handler_timeout"), c.HandlerTimeout)
	chk.Positive(at("max_metadata_bytes"), c.MaxMetadataBytes)

	chk.Positive(at("retry.max_attempts"), c.Retry.MaxAttempts)
	chk.PositiveDuration(at("retry.initial_interval"), c.Retry.InitialInterval)
	if c.Retry.Multiplier < 1 {
		chk.Add(at("retry.multiplier"), "must be at least 1; got %g", c.Retry.Multiplier)
	}
	if c.Retry.MaxInterval < c.Retry.InitialInterval {
		chk.Add(at("retry.max_interval"), "must be at least retry.initial_interval (%s); got %s", c.Retry.InitialInterval, c.Retry.MaxInterval)
	}
	chk.PositiveDuration(at("retry.max_elapsed"), c.Retry.MaxElapsed)
	chk.OneOf(at("retry.mode"), c.Retry.Mode, RetryAuto, RetryInProcess)

	chk.Positive(at("breaker.consecutive_failures"), c.Breaker.ConsecutiveFailures)
	chk.PositiveDuration(at("breaker.open_timeout"), c.Breaker.OpenTimeout)
	chk.Positive(at("breaker.half_open_requests"), c.Breaker.HalfOpenRequests)

	chk.Positive(at("batch.max_messages"), c.Batch.MaxMessages)
	if c.Batch.MaxMessages > MaxBatchMessages {
		chk.Add(at("batch.max_messages"), "must be at most %d; got %d", MaxBatchMessages, c.Batch.MaxMessages)
	}
	chk.PositiveDuration(at("batch.max_wait"), c.Batch.MaxWait)
	if c.Batch.MaxWait >= c.HandlerTimeout {
		chk.Add(at("batch.max_wait"), "must be less than handler_timeout (%s); got %s", c.HandlerTimeout, c.Batch.MaxWait)
	}

	chk.OneOf(at("poison.destination"), c.Poison.Destination, PoisonToTable, PoisonToTopic)
	if c.Poison.Destination == PoisonToTopic {
		chk.Check(at("poison.topic"), names.Topic(c.Poison.Topic))
		if c.Poison.Park != nil && *c.Poison.Park {
			chk.Add(at("poison.park"), "needs poison.destination %q (replay and skip release a park from the poison table); got %q", PoisonToTable, c.Poison.Destination)
		}
	}
}
