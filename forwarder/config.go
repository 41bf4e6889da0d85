package forwarder

import (
	"cmp"
	"time"

	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/store"
)

// Config is the relay section of config.yaml.
type Config struct {
	// Enabled runs the relay inside the service's bus.Run. Turn it off when the
	// relay runs as its own process (`millrace relay`). Defaults to true.
	Enabled *bool `yaml:"enabled"`
	// ConsumerGroup names the relay's row in the offsets table. Relays with the
	// same group share one position: one is active, the others are hot
	// standbys. Defaults to "millrace_relay".
	ConsumerGroup string `yaml:"consumer_group"`
	// BatchSize is how many outbox rows are read, published and acked per
	// database transaction. Defaults to 2000.
	BatchSize int `yaml:"batch_size"`
	// MaxInFlight bounds the messages published to the broker and not yet
	// confirmed; a batch larger than it is published in slices. Defaults to 2000.
	MaxInFlight int `yaml:"max_in_flight"`
	// RateLimit caps the relay at this many messages per second so a backlog
	// drains without flooding consumers; 0 means no limit. Defaults to 0.
	RateLimit int `yaml:"rate_limit"`
	// PollInterval is the fallback poll when no NOTIFY arrives (a missed
	// notification), and the only wake-up of a relay that cannot LISTEN (a
	// pooler in transaction mode and no database.direct_url): its events
	// then wait half of it on average. With relay.source: wal it is how
	// often the relay confirms its slot's position (the events a relay
	// that dies had relayed since are sent again). Defaults to 1s.
	PollInterval time.Duration `yaml:"poll_interval"`
	// LeaseTTL is how long the lease on the outbox (or on a shard) lasts
	// without renewal; the active relay renews it three times as often. A
	// standby takes over when the lease is released (a clean stop), when
	// the leader's direct notification connection closes (its process
	// died), or at the latest lease_ttl after the leader's last renewal.
	// Every write of a relay names its lease's fence, so a relay that lost
	// its lease changes nothing. Defaults to 10s.
	LeaseTTL time.Duration `yaml:"lease_ttl"`
	// RetryInitial is the first wait after a failed publish; waits double, with
	// jitter, up to RetryMax. Defaults to 100ms.
	RetryInitial time.Duration `yaml:"retry_initial"`
	// RetryMax caps the wait between publish attempts while the broker is
	// down. Defaults to 10s.
	RetryMax time.Duration `yaml:"retry_max"`
	// Retention is how long forwarded rows stay in the outbox before cleanup
	// deletes them; 0 deletes them at the next cleanup. Defaults to 1h.
	Retention *time.Duration `yaml:"retention"`
	// CleanupInterval is how often forwarded rows older than Retention are
	// deleted. Defaults to 1m.
	CleanupInterval time.Duration `yaml:"cleanup_interval"`
	// CleanupBatch bounds the rows one cleanup DELETE removes, so cleanup never
	// holds a long transaction. Defaults to 5000.
	CleanupBatch int `yaml:"cleanup_batch"`
	// Shards is how many shards the outbox is split into by a hash of the
	// aggregate id, each owned by one relay at a time; running relays
	// spread the shards among themselves. 1 is one active relay per outbox
	// and consumer group, the others hot standbys. A relay started with
	// another count than the outbox's pending rows were written with
	// refuses to start: change it by the procedure in docs/SHARDS.md
	// (stop the relays, wait for 0 pending, start them with the new
	// count). At most 256. Defaults to 1. With relay.source: wal the one
	// active relay reads the one slot and publishes each batch in Shards
	// lanes at once, by a hash of the aggregate id, each lane in commit
	// order; the outbox table itself is then one shard.
	Shards *int `yaml:"shards"`
	// BacklogInterval is how often the active relay counts its backlog in the
	// database for the pending-rows and oldest-age gauges, on a timer of its
	// own, so that they rise while batches fail (a broker outage). It skips
	// the count when its last read found nothing pending within the
	// interval, so an idle relay adds no statement. Defaults to 5s.
	BacklogInterval time.Duration `yaml:"backlog_interval"`
	// SchedulePollInterval is the longest the relay's scheduler sleeps
	// between two looks at the scheduled messages, a fallback: it wakes at
	// the next message's due time, and at once when a sooner one is
	// scheduled (NOTIFY). Defaults to 1m.
	SchedulePollInterval time.Duration `yaml:"schedule_poll_interval"`
	// ShutdownTimeout bounds how long a stopping relay waits for the batch in
	// flight to be confirmed; after it, the batch is abandoned unacked (and
	// published again by the next relay). Defaults to 10s.
	ShutdownTimeout time.Duration `yaml:"shutdown_timeout"`
	// Source is where the relay reads the outbox's events: "table" polls
	// the outbox table (woken by NOTIFY); "wal" streams its inserts from a
	// logical replication slot in commit order (wal_level = logical and the
	// REPLICATION privilege; see docs/WAL.md), deleting each row once the
	// broker confirmed it, so that relay.retention does not apply. "wal"
	// needs relay.shards: 1. Defaults to "table".
	Source string `yaml:"source"`
	// WALSlot names the logical replication slot of relay.source: wal: at
	// most 63 bytes of lowercase letters, digits and '_', not starting
	// with a digit. A slot belongs to the PostgreSQL cluster, not to one
	// database: relays of different outboxes need different slots.
	// Defaults to the consumer group, database schema and outbox topic
	// joined by '_' ('.' and '-' become '_', letters lowercase), cut to 54
	// bytes and ended by a hash of the whole when longer than 63 bytes
	// (see SlotName).
	WALSlot string `yaml:"wal_slot"`
}

// minLeaseTTL is the shortest relay.lease_ttl: a renewal every third of it
// must fit a statement's round trip on a loaded database.
const minLeaseTTL = 300 * time.Millisecond

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	if c.Enabled == nil {
		c.Enabled = new(true)
	}
	c.ConsumerGroup = cmp.Or(c.ConsumerGroup, "millrace_relay")
	c.BatchSize = cmp.Or(c.BatchSize, 2000)
	c.MaxInFlight = cmp.Or(c.MaxInFlight, 2000)
	c.PollInterval = cmp.Or(c.PollInterval, time.Second)
	c.LeaseTTL = cmp.Or(c.LeaseTTL, 10*time.Second)
	c.RetryInitial = cmp.Or(c.RetryInitial, 100*time.Millisecond)
	c.RetryMax = cmp.Or(c.RetryMax, 10*time.Second)
	if c.Retention == nil {
		c.Retention = new(time.Hour)
	}
	c.CleanupInterval = cmp.Or(c.CleanupInterval, time.Minute)
	c.CleanupBatch = cmp.Or(c.CleanupBatch, 5000)
	if c.Shards == nil {
		c.Shards = new(1)
	}
	c.BacklogInterval = cmp.Or(c.BacklogInterval, 5*time.Second)
	c.SchedulePollInterval = cmp.Or(c.SchedulePollInterval, time.Minute)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, 10*time.Second)
	c.Source = cmp.Or(c.Source, SourceTable)
	return c
}

// Validate returns every problem in c, each naming its YAML path under path.
func (c Config) Validate(path string) []error {
	var chk confload.Checker
	at := func(key string) string { return confload.Join(path, key) }
	chk.Check(at("consumer_group"), names.Topic(c.ConsumerGroup))
	chk.Positive(at("batch_size"), c.BatchSize)
	chk.Positive(at("max_in_flight"), c.MaxInFlight)
	chk.NonNegative(at("rate_limit"), c.RateLimit)
	chk.PositiveDuration(at("poll_interval"), c.PollInterval)
	if c.LeaseTTL < minLeaseTTL {
		chk.Add(at("lease_ttl"), "must be at least %s (renewed every third of it); got %s", minLeaseTTL, c.LeaseTTL)
	}
	chk.PositiveDuration(at("retry_initial"), c.RetryInitial)
	chk.PositiveDuration(at("retry_max"), c.RetryMax)
	if c.RetryMax < c.RetryInitial {
		chk.Add(at("retry_max"), "must not be shorter than retry_initial (%s); got %s", c.RetryInitial, c.RetryMax)
	}
	if c.Retention != nil {
		chk.NonNegativeDuration(at("retention"), *c.Retention)
	}
	chk.PositiveDuration(at("cleanup_interval"), c.CleanupInterval)
	chk.Positive(at("cleanup_batch"), c.CleanupBatch)
	if c.Shards != nil {
		switch n := *c.Shards; {
		case n < 1:
			chk.Add(at("shards"), "must be at least 1 (1 is one active relay for the whole outbox); got %d", n)
		case n > store.MaxShards:
			chk.Add(at("shards"), "must be at most %d; got %d", store.MaxShards, n)
		}
	}
	chk.PositiveDuration(at("backlog_interval"), c.BacklogInterval)
	chk.PositiveDuration(at("schedule_poll_interval"), c.SchedulePollInterval)
	chk.PositiveDuration(at("shutdown_timeout"), c.ShutdownTimeout)
	c.validateSource(&chk, at)
	return chk.Problems
}
