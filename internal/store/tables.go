package store

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	watermillsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/millrace-io/millrace/internal/names"
)

// NotifyChannel is the LISTEN/NOTIFY channel the outbox trigger signals on
// commit; the payload is the outbox table's qualified name.
const NotifyChannel = "millrace_outbox"

// Tables names every table of one millrace installation.
type Tables struct {
	// Schema is the PostgreSQL schema holding every table.
	Schema string
	// OutboxTopic is the watermill-sql topic of the outbox (the forwarder topic).
	OutboxTopic string

	// relay names the relay instance whose statements these Tables run
	// (ForRelay); "" for any other caller.
	relay string
}

// ForRelay returns t for the statements of relay instance id: they carry
// its name, so that RelayWaits on the result finds its waits alone.
func (t Tables) ForRelay(id string) Tables {
	t.relay = strings.ReplaceAll(id, "*/", "") // it goes into an SQL comment
	return t
}

// MaxIdentifierLength is PostgreSQL's limit on identifiers, in bytes.
const MaxIdentifierLength = 63

// MaxOutboxTopicLength is the longest outbox topic: "watermill_offsets_" +
// topic must fit in an identifier.
const MaxOutboxTopicLength = MaxIdentifierLength - len("watermill_offsets_")

// Validate reports a schema or outbox topic that cannot be part of an SQL
// identifier (names.Identifier: lowercase letters, digits and '_'). Every
// function that builds SQL from Tables calls it first: the names are
// quoted, but never trusted.
func (t Tables) Validate() error {
	var errs []error
	if err := names.Schema(t.Schema, MaxIdentifierLength); err != nil {
		errs = append(errs, fmt.Errorf("schema %q: %w", t.Schema, err))
	}
	if err := names.Identifier(t.OutboxTopic, MaxOutboxTopicLength); err != nil {
		errs = append(errs, fmt.Errorf("outbox topic %q: %w", t.OutboxTopic, err))
	}
	return errors.Join(errs...)
}

func (t Tables) qualify(name string) string {
	return fmt.Sprintf(`"%s"."%s"`, t.Schema, name)
}

// OutboxTable is the qualified outbox table, watermill-sql's "watermill_<topic>".
func (t Tables) OutboxTable() string { return t.qualify("watermill_" + t.OutboxTopic) }

// OffsetsTable is the qualified offsets table, watermill-sql's "watermill_offsets_<topic>".
func (t Tables) OffsetsTable() string { return t.qualify("watermill_offsets_" + t.OutboxTopic) }

// InboxTable is the qualified inbox (processed messages) table.
func (t Tables) InboxTable() string { return t.qualify("millrace_inbox") }

// QuarantineTable is the qualified table where the relay moves outbox rows it
// can never publish (corrupt envelope, message over the broker's limit).
func (t Tables) QuarantineTable() string { return t.qualify("millrace_relay_quarantine") }

// PoisonTable is the qualified poison (quarantine) table: messages the consumer
// middleware gave up on, with their failure envelope, for listing and replay.
func (t Tables) PoisonTable() string { return t.qualify("millrace_poison") }

// PoisonReplaysTable is the qualified table of replay history: one row each time
// `millrace dlq replay` sent a poisoned message back through the outbox.
func (t Tables) PoisonReplaysTable() string { return t.qualify("millrace_poison_replays") }

// AggregateVersionsTable is the qualified table of the ordering guard: the latest
// aggregate version each consumer group applied, per aggregate.
func (t Tables) AggregateVersionsTable() string { return t.qualify("millrace_aggregate_versions") }

// OutboxNotifyPayload is the NOTIFY payload that names this outbox. An
// unsharded outbox notifies with it; a sharded one with it, "/" and the
// shard of each row committed (see NotifiedShard).
func (t Tables) OutboxNotifyPayload() string { return t.Schema + ".watermill_" + t.OutboxTopic }

// ProbePayload is the NOTIFY payload a relay instance sends itself to check
// that notifications reach it; no outbox's relays take it for theirs.
func (t Tables) ProbePayload(instance string) string {
	return t.OutboxNotifyPayload() + "#probe " + instance
}

// NotifiedShard reads a notification of NotifyChannel: whether it names
// this outbox, and the shard it names, or -1 when it names the whole
// outbox (an unsharded outbox's, or one of a trigger older than shards).
func (t Tables) NotifiedShard(payload string) (shard int, ours bool) {
	rest, ok := strings.CutPrefix(payload, t.OutboxNotifyPayload())
	switch {
	case !ok:
		return 0, false
	case rest == "":
		return -1, true
	}
	digits, ok := strings.CutPrefix(rest, "/")
	if !ok {
		return 0, false // another outbox whose name starts with this one's
	}
	shard, err := strconv.Atoi(digits)
	if err != nil || shard < 0 {
		return -1, true // ours, but unreadable: wake every shard rather than none
	}
	return shard, true
}

// SchemaAdapter is watermill-sql's PostgreSQL schema adapter pointed at the outbox table.
func (t Tables) SchemaAdapter() watermillsql.DefaultPostgreSQLSchema {
	return watermillsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(string) string { return t.OutboxTable() },
	}
}

// OffsetsAdapter is watermill-sql's PostgreSQL offsets adapter pointed at the offsets table.
func (t Tables) OffsetsAdapter() watermillsql.DefaultPostgreSQLOffsetsAdapter {
	return watermillsql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(string) string { return t.OffsetsTable() },
	}
}
