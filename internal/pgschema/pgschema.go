// Package pgschema names millrace's PostgreSQL tables and creates them.
//
// The outbox and offsets tables keep exactly the layout of watermill-sql's
// DefaultPostgreSQLSchema and DefaultPostgreSQLOffsetsAdapter, so rows written
// by plain Watermill land in, and are relayed from, the same table.
package pgschema

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

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

// Outbox is the qualified outbox table, watermill-sql's "watermill_<topic>".
func (t Tables) Outbox() string { return t.qualify("watermill_" + t.OutboxTopic) }

// Offsets is the qualified offsets table, watermill-sql's "watermill_offsets_<topic>".
func (t Tables) Offsets() string { return t.qualify("watermill_offsets_" + t.OutboxTopic) }

// Inbox is the qualified inbox (processed messages) table.
func (t Tables) Inbox() string { return t.qualify("millrace_inbox") }

// RelayQuarantine is the qualified table where the relay moves outbox rows it
// can never publish (corrupt envelope, message over the broker's limit).
func (t Tables) RelayQuarantine() string { return t.qualify("millrace_relay_quarantine") }

// Poison is the qualified poison (quarantine) table: messages the consumer
// middleware gave up on, with their failure envelope, for listing and replay.
func (t Tables) Poison() string { return t.qualify("millrace_poison") }

// PoisonReplays is the qualified table of replay history: one row each time
// `millrace dlq replay` sent a poisoned message back through the outbox.
func (t Tables) PoisonReplays() string { return t.qualify("millrace_poison_replays") }

// AggregateVersions is the qualified table of the ordering guard: the latest
// aggregate version each consumer group applied, per aggregate.
func (t Tables) AggregateVersions() string { return t.qualify("millrace_aggregate_versions") }

// OutboxNotifyPayload is the NOTIFY payload that names this outbox.
func (t Tables) OutboxNotifyPayload() string { return t.Schema + ".watermill_" + t.OutboxTopic }

// SchemaAdapter is watermill-sql's PostgreSQL schema adapter pointed at the outbox table.
func (t Tables) SchemaAdapter() watermillsql.DefaultPostgreSQLSchema {
	return watermillsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(string) string { return t.Outbox() },
	}
}

// OffsetsAdapter is watermill-sql's PostgreSQL offsets adapter pointed at the offsets table.
func (t Tables) OffsetsAdapter() watermillsql.DefaultPostgreSQLOffsetsAdapter {
	return watermillsql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(string) string { return t.Offsets() },
	}
}

// migrateLockKey serialises concurrent Migrate calls across processes
// (CREATE ... IF NOT EXISTS alone still races on the catalog).
const migrateLockKey = 0x6d696c6c72616365 // "millrace"

// Migrate creates every table, index and trigger millrace needs (outbox,
// offsets, inbox, poison, poison-replay and aggregate-versions tables), idempotently,
// in one transaction under an advisory lock so that several instances may run
// it at once.
func Migrate(ctx context.Context, db *sql.DB, t Tables) error {
	if err := t.Validate(); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin migration: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit

	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(migrateLockKey)); err != nil {
		return fmt.Errorf("take migration lock: %w", err)
	}
	for _, stmt := range statements(t) {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("migrate: %w\n%s", err, stmt)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit migration: %w", err)
	}
	return nil
}

func statements(t Tables) []string {
	schema := t.SchemaAdapter()
	offsets := t.OffsetsAdapter()
	var stmts []string
	// CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the
	// schema exists; asking first lets the schema's owner migrate without it.
	stmts = append(stmts, fmt.Sprintf(`DO $$ BEGIN
	IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = '%s') THEN
		CREATE SCHEMA "%s";
	END IF;
END $$`, t.Schema, t.Schema))
	for _, q := range schema.SchemaInitializingQueries(t.OutboxTopic) {
		stmts = append(stmts, q.Query)
	}
	for _, q := range offsets.SchemaInitializingQueries(t.OutboxTopic) {
		stmts = append(stmts, q.Query)
	}
	notifyFunc := t.qualify("millrace_notify_outbox")
	stmts = append(stmts,
		// One notification per inserting statement (not per row); PostgreSQL
		// delivers it at commit and folds duplicates within a transaction.
		`CREATE OR REPLACE FUNCTION `+notifyFunc+`() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_notify('`+NotifyChannel+`', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
	RETURN NULL;
END $$`,
		// Created only when missing: re-creating it would lock the outbox
		// against writers every time an instance starts.
		`DO $$ BEGIN
	IF NOT EXISTS (SELECT 1 FROM pg_trigger
		WHERE tgname = 'millrace_notify_outbox' AND tgrelid = '`+t.Outbox()+`'::regclass) THEN
		CREATE TRIGGER millrace_notify_outbox AFTER INSERT ON `+t.Outbox()+`
			FOR EACH STATEMENT EXECUTE FUNCTION `+notifyFunc+`();
	END IF;
END $$`,
		`CREATE TABLE IF NOT EXISTS `+t.Inbox()+` (
	consumer_group TEXT NOT NULL,
	event_id TEXT NOT NULL,
	processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	PRIMARY KEY (consumer_group, event_id)
)`,
		`CREATE INDEX IF NOT EXISTS millrace_inbox_processed_at ON `+t.Inbox()+` (processed_at)`,
		`CREATE TABLE IF NOT EXISTS `+t.RelayQuarantine()+` (
	id BIGSERIAL PRIMARY KEY,
	outbox_offset BIGINT NOT NULL,
	outbox_uuid TEXT NOT NULL,
	destination_topic TEXT,
	event_id TEXT,
	payload BYTEA NOT NULL,
	metadata TEXT,
	reason TEXT NOT NULL,
	quarantined_at TIMESTAMPTZ NOT NULL DEFAULT now()
)`,
		// One row per poisoned message and (consumer group, handler); poisoning
		// the same message again updates it. The envelope fields are columns
		// so that an operator can list, filter, show, replay and purge.
		`CREATE TABLE IF NOT EXISTS `+t.Poison()+` (
	id BIGSERIAL PRIMARY KEY,
	consumer_group TEXT NOT NULL,
	handler TEXT NOT NULL,
	source_topic TEXT NOT NULL,
	message_id TEXT NOT NULL,
	event_id TEXT NOT NULL,
	event_type TEXT NOT NULL,
	payload BYTEA NOT NULL,
	metadata JSONB NOT NULL,
	reason TEXT NOT NULL,
	error_class TEXT NOT NULL,
	attempts INTEGER NOT NULL,
	first_failure_at TIMESTAMPTZ NOT NULL,
	last_failure_at TIMESTAMPTZ NOT NULL,
	traceparent TEXT NOT NULL,
	poisoned_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	times_poisoned INTEGER NOT NULL DEFAULT 1,
	replayed_at TIMESTAMPTZ,
	UNIQUE (consumer_group, handler, message_id)
)`,
		`CREATE INDEX IF NOT EXISTS millrace_poison_poisoned_at ON `+t.Poison()+` (poisoned_at)`,
		`CREATE INDEX IF NOT EXISTS millrace_poison_event_id ON `+t.Poison()+` (event_id)`,
		// Replay history of the poison table; a replay re-sends the message with
		// a new message id (message_id here) and the same event id. Purging a
		// poison row drops its history.
		`CREATE TABLE IF NOT EXISTS `+t.PoisonReplays()+` (
	id BIGSERIAL PRIMARY KEY,
	poison_id BIGINT NOT NULL REFERENCES `+t.Poison()+` (id) ON DELETE CASCADE,
	message_id TEXT NOT NULL,
	replayed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	replayed_by TEXT NOT NULL,
	times_poisoned INTEGER NOT NULL
)`,
		`CREATE INDEX IF NOT EXISTS millrace_poison_replays_poison_id ON `+t.PoisonReplays()+` (poison_id)`,
		`CREATE TABLE IF NOT EXISTS `+t.AggregateVersions()+` (
	consumer_group TEXT NOT NULL,
	aggregate_type TEXT NOT NULL,
	aggregate_id TEXT NOT NULL,
	version BIGINT NOT NULL,
	event_id TEXT NOT NULL,
	updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	PRIMARY KEY (consumer_group, aggregate_type, aggregate_id)
)`,
	)
	return stmts
}
