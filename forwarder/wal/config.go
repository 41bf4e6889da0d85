package wal

import (
	"errors"
	"fmt"
	"time"

	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/store"
)

// Defaults of Config.
const (
	// DefaultStatusInterval is how often the Reader sends a standby status
	// update when Config.StatusInterval is zero.
	DefaultStatusInterval = 10 * time.Second
	// DefaultMaxBatchEvents bounds a batch when Config.MaxBatchEvents is zero.
	DefaultMaxBatchEvents = 1000
)

// Config says which outbox to read and through which slot.
type Config struct {
	// URL is the PostgreSQL connection string (URL or key=value), with a
	// role that has the REPLICATION privilege. The Reader adds
	// replication=database for its replication connection itself.
	URL string
	// Schema and OutboxTopic name the outbox table,
	// "<Schema>"."watermill_<OutboxTopic>".
	Schema, OutboxTopic string
	// Slot is the logical replication slot's name; by default
	// millrace_<Schema>_<OutboxTopic>, hashed to fit 63 bytes when longer
	// (names.Derived).
	Slot string
	// Publication is the publication's name; by default
	// millrace_<Schema>_<OutboxTopic>, hashed to fit 63 bytes when longer.
	Publication string
	// MessagePrefix, when set, asks pgoutput for logical messages and
	// delivers those written with pg_logical_emit_message under this
	// prefix; messages under other prefixes are skipped. When empty, no
	// logical message is delivered.
	MessagePrefix string
	// StatusInterval is the longest time between two standby status
	// updates (DefaultStatusInterval when zero); it is lowered to half of
	// the server's wal_sender_timeout when that is shorter.
	StatusInterval time.Duration
	// MaxBatchEvents bounds the events of a batch (DefaultMaxBatchEvents
	// when zero); a transaction with more events is still one batch. The
	// Reader buffers at most about as many events again while the Handler
	// works.
	MaxBatchEvents int
}

// withDefaults returns c with its defaults filled in, or the first field
// that cannot be used.
func (c Config) withDefaults() (Config, error) {
	tables := store.Tables{Schema: c.Schema, OutboxTopic: c.OutboxTopic}
	if err := tables.Validate(); err != nil {
		return c, fmt.Errorf("wal: %w", err)
	}
	if c.URL == "" {
		return c, errors.New("wal: Config.URL is empty")
	}
	def := defaultName(c.Schema, c.OutboxTopic)
	if c.Slot == "" {
		c.Slot = def
	}
	if c.Publication == "" {
		c.Publication = def
	}
	for _, n := range []struct{ what, name string }{{"slot", c.Slot}, {"publication", c.Publication}} {
		if err := names.Identifier(n.name, store.MaxIdentifierLength); err != nil {
			return c, fmt.Errorf("wal: %s name %q : %w", n.what, n.name, err)
		}
	}
	if c.StatusInterval <= 0 {
		c.StatusInterval = DefaultStatusInterval
	}
	if c.MaxBatchEvents <= 0 {
		c.MaxBatchEvents = DefaultMaxBatchEvents
	}
	return c, nil
}

// defaultName is the slot's and the publication's name by default:
// millrace_<schema>_<outboxTopic>, hashed to fit 63 bytes when longer.
func defaultName(schema, outboxTopic string) string {
	return names.Derived(store.MaxIdentifierLength, "millrace", schema, outboxTopic)
}

// outboxTable is the outbox's schema and table name.
func (c Config) outboxTable() (schema, table string) {
	return c.Schema, "watermill_" + c.OutboxTopic
}
