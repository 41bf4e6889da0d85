package wal

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
)

// LSN is a position in the write-ahead log.
type LSN = pglogrepl.LSN

// SlotStatus is a replication slot's state, from pg_replication_slots.
type SlotStatus struct {
	// Name and Plugin are the slot's name and output plugin.
	Name, Plugin string
	// Active is true while a replication connection reads the slot.
	Active bool
	// WALStatus is "reserved", "extended", "unreserved" or "lost" (the
	// slot was invalidated and can never be read again).
	WALStatus string
	// RestartLSN is the oldest WAL the slot retains; ConfirmedFlushLSN is
	// where its reader resumes.
	RestartLSN, ConfirmedFlushLSN LSN
	// RetainedBytes is the WAL the slot keeps on disk,
	// pg_current_wal_lsn() - restart_lsn.
	RetainedBytes int64
}

// Status returns the state of slot on the server at url (ErrNoSlot when it
// does not exist). It reads pg_replication_slots on an ordinary
// connection.
func Status(ctx context.Context, url, slot string) (SlotStatus, error) {
	conn, err := pgconn.Connect(ctx, url)
	if err != nil {
		return SlotStatus{}, fmt.Errorf("wal: connect: %w", err)
	}
	defer closeConn(conn)
	return slotStatus(ctx, conn, slot)
}

// slotStatus reads slot's row of pg_replication_slots on conn.
func slotStatus(ctx context.Context, conn *pgconn.PgConn, slot string) (SlotStatus, error) {
	row, err := queryRow(ctx, conn, `SELECT slot_name, coalesce(plugin, ''), active, coalesce(wal_status, ''),
		coalesce(restart_lsn, '0/0')::text, coalesce(confirmed_flush_lsn, '0/0')::text,
		coalesce(pg_current_wal_lsn() - restart_lsn, 0)::bigint, slot_type, coalesce(database = current_database(), false)
		FROM pg_replication_slots WHERE slot_name = `+quoteLiteral(slot))
	if errors.Is(err, errNoRows) {
		return SlotStatus{}, fmt.Errorf("wal: %w: %q", ErrNoSlot, slot)
	}
	if err != nil {
		return SlotStatus{}, fmt.Errorf("wal: read slot %q: %w", slot, err)
	}
	s := SlotStatus{Name: string(row[0]), Plugin: string(row[1]), Active: string(row[2]) == "t", WALStatus: string(row[3])}
	if s.RestartLSN, err = pglogrepl.ParseLSN(string(row[4])); err == nil {
		s.ConfirmedFlushLSN, err = pglogrepl.ParseLSN(string(row[5]))
	}
	if err == nil {
		s.RetainedBytes, err = strconv.ParseInt(string(row[6]), 10, 64)
	}
	if err != nil {
		return SlotStatus{}, fmt.Errorf("wal: read slot %q: %w", slot, err)
	}
	if string(row[7]) != "logical" || s.Plugin != "pgoutput" || string(row[8]) != "t" {
		return s, fmt.Errorf("wal: slot %q is a %s slot with plugin %q in another or no database, not a pgoutput slot of this database: "+
			"choose another Config.Slot", slot, row[7], s.Plugin)
	}
	return s, nil
}

// DropSlot drops slot on the server at url, releasing the WAL it retains.
// A relay reading it must be stopped first; ErrNoSlot when it does not
// exist. The events committed since the slot's confirmed LSN and not yet
// relayed are then no longer in any slot.
func DropSlot(ctx context.Context, url, slot string) error {
	conn, err := pgconn.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("wal: connect: %w", err)
	}
	defer closeConn(conn)
	err = exec(ctx, conn, `SELECT pg_drop_replication_slot(`+quoteLiteral(slot)+`)`)
	switch sqlState(err) {
	case "":
		return nil
	case "42704": // undefined_object
		return fmt.Errorf("wal: %w: %q", ErrNoSlot, slot)
	case "55006": // object_in_use
		return fmt.Errorf("wal: slot %q is in use by a relay: stop it first: %w", slot, err)
	}
	return fmt.Errorf("wal: drop slot %q: %w", slot, err)
}

// lostError is ErrSlotLost for slot, with what to do.
func lostError(slot string, cause error) error {
	err := fmt.Errorf("wal: %w: PostgreSQL removed WAL that slot %q still needed (max_slot_wal_keep_size was passed) "+
		"and can never stream from it again; events committed since its confirmed LSN may not have been relayed: "+
		"drop the slot (wal.DropSlot), reconcile those events from the outbox table, and start the relay again, "+
		"which creates a new slot", ErrSlotLost, slot)
	if cause != nil {
		err = fmt.Errorf("%w (%w)", err, cause)
	}
	return err
}

// ensureSlot creates slot when it is missing and returns its state; a
// lost slot is ErrSlotLost.
func ensureSlot(ctx context.Context, conn *pgconn.PgConn, slot string) (SlotStatus, error) {
	s, err := slotStatus(ctx, conn, slot)
	if errors.Is(err, ErrNoSlot) {
		s, err = createSlot(ctx, conn, slot)
		if errors.Is(err, ErrSlotExists) { // created meanwhile: fine
			s, err = slotStatus(ctx, conn, slot)
		}
	}
	if err != nil {
		return s, err
	}
	if s.WALStatus == "lost" {
		return s, lostError(slot, nil)
	}
	return s, nil
}

// createSlot creates slot and returns its state, or ErrSlotExists.
// Creating a slot waits for the transactions running at that moment to
// end.
func createSlot(ctx context.Context, conn *pgconn.PgConn, slot string) (SlotStatus, error) {
	err := exec(ctx, conn, `SELECT pg_create_logical_replication_slot(`+quoteLiteral(slot)+`, 'pgoutput')`)
	switch sqlState(err) {
	case "":
		return slotStatus(ctx, conn, slot)
	case "42710": // duplicate_object
		return SlotStatus{}, fmt.Errorf("wal: %w: %q", ErrSlotExists, slot)
	}
	return SlotStatus{}, fmt.Errorf("wal: create slot %q: %w", slot, err)
}

// CreateSlot checks the requirements (see Check), creates cfg's
// publication when it is missing and creates cfg's slot, returning its
// state; ErrSlotExists when the slot exists already. The slot holds the
// events committed from the moment it is created (after the transactions
// running then have ended, which it waits for); New creates a missing slot
// too, so CreateSlot is for an operator who wants the slot to exist before
// the relay starts, or again after it was dropped.
func CreateSlot(ctx context.Context, cfg Config) (SlotStatus, error) {
	_, _, s, err := prepare(ctx, cfg, createSlot)
	return s, err
}

// droppedError is ErrNoSlot for a slot that was dropped while a Reader
// used it, with what to do.
func droppedError(slot string, cause error) error {
	return fmt.Errorf("wal: %w: %q was dropped while the relay used it; the events committed while no slot existed "+
		"are in no slot: create the slot again (CreateSlot, or New, which creates a missing slot) and forward what "+
		"the outbox table still holds before streaming: %w", ErrNoSlot, slot, cause)
}

// ensurePublication creates cfg's publication of the outbox's inserts when
// it is missing, and checks that an existing one publishes the outbox.
func ensurePublication(ctx context.Context, conn *pgconn.PgConn, cfg Config) error {
	schema, table := cfg.outboxTable()
	qualified := quoteIdent(schema) + "." + quoteIdent(table)
	row, err := queryRow(ctx, conn, `SELECT to_regclass(`+quoteLiteral(qualified)+`) IS NOT NULL,
		EXISTS (SELECT 1 FROM pg_publication WHERE pubname = `+quoteLiteral(cfg.Publication)+`),
		EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = `+quoteLiteral(cfg.Publication)+`
			AND schemaname = `+quoteLiteral(schema)+` AND tablename = `+quoteLiteral(table)+`)`)
	if err != nil {
		return fmt.Errorf("wal: read publication %q: %w", cfg.Publication, err)
	}
	switch {
	case string(row[0]) != "t":
		return fmt.Errorf("wal: the outbox table %s does not exist: run millrace migrate", qualified)
	case string(row[2]) == "t":
		return nil
	case string(row[1]) == "t":
		return fmt.Errorf("wal: %w: publication %q does not publish the outbox table: run ALTER PUBLICATION %s ADD TABLE %s",
			ErrPublication, cfg.Publication, quoteIdent(cfg.Publication), qualified)
	}
	err = exec(ctx, conn, createPublication(cfg))
	switch sqlState(err) {
	case "", "42710": // duplicate_object: created meanwhile
		return nil
	case "42501": // insufficient_privilege
		return fmt.Errorf("wal: %w: role may not create publication %q: CREATE PUBLICATION needs the owner of %s with CREATE "+
			"on the database, or a superuser; have one run (`millrace grants` prints it): %s: %w",
			ErrPublication, cfg.Publication, qualified, publicationSQL(cfg), err)
	}
	return fmt.Errorf("wal: create publication %q: %w", cfg.Publication, err)
}

// createPublication is the statement that creates cfg's publication of the
// outbox's inserts.
func createPublication(cfg Config) string {
	schema, table := cfg.outboxTable()
	return `CREATE PUBLICATION ` + quoteIdent(cfg.Publication) + ` FOR TABLE ` + quoteIdent(schema) + "." + quoteIdent(table) +
		` WITH (publish = 'insert')`
}

// publicationSQL is createPublication run only when the publication is
// missing, so that running it again changes nothing.
func publicationSQL(cfg Config) string {
	return `DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_publication WHERE pubname = ` + quoteLiteral(cfg.Publication) +
		`) THEN ` + createPublication(cfg) + `; END IF; END $$;`
}

// PublicationSQL is the statement, after a comment saying what needs it,
// that creates, when it is missing, the
// publication New reads the outbox of topic outboxTopic in schema through
// (Config.Publication's default). CREATE PUBLICATION needs the outbox
// table's owner with CREATE on the database, or a superuser: a service
// role with only its grants cannot run it, so an operator does, before
// the relay starts (`millrace grants` prints it). schema and outboxTopic
// must be valid (store.Tables.Validate).
func PublicationSQL(schema, outboxTopic string) string {
	return "-- relay with relay.source: wal: the publication its slot streams the outbox through (run as a superuser, " +
		"or as the outbox table's owner with CREATE on the database: the service role cannot create it)\n" + publicationSQL(Config{Schema: schema, OutboxTopic: outboxTopic, Publication: defaultName(schema, outboxTopic)}) + "\n"
}
