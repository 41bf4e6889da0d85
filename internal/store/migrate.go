package store

import (
	"context"
	"database/sql"
	"fmt"
)

// migrateLockKey serialises concurrent Migrate calls across processes
// (CREATE ... IF NOT EXISTS alone still races on the catalog).
const migrateLockKey = 0x6d696c6c72616365 // "millrace"

// Migrate creates every table, index and trigger millrace needs (outbox with
// its shard column, offsets, relay cursors, shard count, relay registry, inbox, poison,
// poison-replay, parked-aggregate, aggregate-versions, scheduled and saga tables), idempotently,
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
	stmts = append(stmts, t.shardStatements()...)
	stmts = append(stmts, t.cursorStatements()...)
	stmts = append(stmts, t.brokerStatements()...)
	stmts = append(stmts, t.notifyStatements()...)
	stmts = append(stmts, t.inboxStatements()...)
	stmts = append(stmts, t.quarantineStatements()...)
	stmts = append(stmts, t.poisonStatements()...)
	stmts = append(stmts, t.parkStatements()...)
	stmts = append(stmts, t.aggregateVersionStatements()...)
	stmts = append(stmts, t.scheduledStatements()...)
	return append(stmts, t.sagaStatements()...)
}

// notifyStatements create the trigger that notifies the relay of new
// outbox rows.
func (t Tables) notifyStatements() []string {
	notifyFunc := t.qualify("millrace_notify_outbox")
	return []string{
		// One notification per inserting statement (not per row); PostgreSQL
		// delivers it at commit and folds duplicates within a transaction.
		// A sharded outbox is notified per shard by the shard trigger instead.
		`CREATE OR REPLACE FUNCTION ` + notifyFunc + `() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
	n integer;
BEGIN
	SELECT shards INTO n FROM ` + t.ShardsTable() + ` WHERE outbox_topic = '` + t.OutboxTopic + `';
	IF n IS NULL OR n <= 1 THEN
		PERFORM pg_notify('` + NotifyChannel + `', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
	END IF;
	RETURN NULL;
END $$`,
		// Created only when missing: re-creating it would lock the outbox
		// against writers every time an instance starts.
		trigger("millrace_notify_outbox", "AFTER INSERT", t.OutboxTable(), "STATEMENT", notifyFunc),
	}
}

// inboxStatements create the consumers' inbox table.
func (t Tables) inboxStatements() []string {
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t.InboxTable() + ` (
	consumer_group TEXT NOT NULL,
	event_id TEXT NOT NULL,
	processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	PRIMARY KEY (consumer_group, event_id)
)`,
		t.index("millrace_inbox_processed_at", t.InboxTable(), `(processed_at)`),
	}
}

// quarantineStatements create the relay's quarantine table.
func (t Tables) quarantineStatements() []string {
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t.QuarantineTable() + ` (
	id BIGSERIAL PRIMARY KEY,
	outbox_offset BIGINT NOT NULL,
	outbox_uuid TEXT NOT NULL,
	destination_topic TEXT,
	event_id TEXT,
	payload BYTEA NOT NULL,
	metadata TEXT,
	reason TEXT NOT NULL,
	quarantined_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	replayed_at TIMESTAMPTZ,
	times_replayed INTEGER NOT NULL DEFAULT 0
)`,
		// Added after the table's first version: installations migrated
		// before get the columns here.
		column(t.QuarantineTable(), "replayed_at", `TIMESTAMPTZ`),
		column(t.QuarantineTable(), "times_replayed", `INTEGER NOT NULL DEFAULT 0`),
		// The poison table finds the quarantined rows of its replays by
		// their outbox uuid, the replay's message id.
		t.index("millrace_relay_quarantine_outbox_uuid", t.QuarantineTable(), `(outbox_uuid)`),
	}
}

// poisonStatements create the consumers' poison table and its replay
// history.
func (t Tables) poisonStatements() []string {
	return []string{
		// One row per poisoned message and (consumer group, handler); poisoning
		// the same message again updates it. The envelope fields are columns
		// so that an operator can list, filter, show, replay and purge.
		`CREATE TABLE IF NOT EXISTS ` + t.PoisonTable() + ` (
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
		t.index("millrace_poison_poisoned_at", t.PoisonTable(), `(poisoned_at)`),
		t.index("millrace_poison_event_id", t.PoisonTable(), `(event_id)`),
		// Replay history of the poison table; a replay re-sends the message with
		// a new message id (message_id here) and the same event id. Purging a
		// poison row drops its history.
		`CREATE TABLE IF NOT EXISTS ` + t.PoisonReplaysTable() + ` (
	id BIGSERIAL PRIMARY KEY,
	poison_id BIGINT NOT NULL REFERENCES ` + t.PoisonTable() + ` (id) ON DELETE CASCADE,
	message_id TEXT NOT NULL,
	replayed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	replayed_by TEXT NOT NULL,
	times_poisoned INTEGER NOT NULL
)`,
		t.index("millrace_poison_replays_poison_id", t.PoisonReplaysTable(), `(poison_id)`),
	}
}

// aggregateVersionStatements create the table of the aggregate versions
// each consumer group has handled.
func (t Tables) aggregateVersionStatements() []string {
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t.AggregateVersionsTable() + ` (
	consumer_group TEXT NOT NULL,
	aggregate_type TEXT NOT NULL,
	aggregate_id TEXT NOT NULL,
	version BIGINT NOT NULL,
	event_id TEXT NOT NULL,
	updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	PRIMARY KEY (consumer_group, aggregate_type, aggregate_id)
)`,
	}
}

// ifMissing runs ddl only when probe (a query) finds no row. IF NOT EXISTS
// alone would still lock the table: CREATE INDEX IF NOT EXISTS takes a
// SHARE lock even when the index exists, so a Migrate at every start waited
// for each writer of the table in flight (an idle-in-transaction session
// for as long as it lived) and held up every writer behind it.
func ifMissing(probe, ddl string) string {
	return "DO $$ BEGIN\n\tIF NOT EXISTS (" + probe + ") THEN\n\t\t" + ddl + ";\n\tEND IF;\nEND $$"
}

// trigger creates the trigger name, timing ("AFTER INSERT") on table, for
// each level ("STATEMENT", "ROW"), calling function, if table has no
// trigger of that name.
func trigger(name, timing, table, level, function string) string {
	return ifMissing(`SELECT 1 FROM pg_trigger WHERE tgname = '`+name+`' AND tgrelid = '`+table+`'::regclass`,
		`CREATE TRIGGER `+name+` `+timing+` ON `+table+` FOR EACH `+level+` EXECUTE FUNCTION `+function+`()`)
}

// index creates the index name on table (columns), if t's schema has no
// relation of that name.
func (t Tables) index(name, table, columns string) string {
	return ifMissing(`SELECT 1 FROM pg_class WHERE relname = '`+name+`' AND relnamespace = '"`+t.Schema+`"'::regnamespace`,
		`CREATE INDEX `+name+` ON `+table+` `+columns)
}

// column adds the column name (decl) to table, if it has none of that name.
func column(table, name, decl string) string {
	return ifMissing(`SELECT 1 FROM pg_attribute WHERE attrelid = '`+table+`'::regclass AND attname = '`+name+`' AND NOT attisdropped`,
		`ALTER TABLE `+table+` ADD COLUMN `+name+` `+decl)
}
