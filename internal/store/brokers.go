package store

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
)

// BrokerKindKey is the key, in an outbox row's own metadata (not the
// event's), of the broker.kind of the service that wrote the row. The
// relay forwards a row only to a broker of that kind.
const BrokerKindKey = "millrace_broker_kind"

// BrokersTable is the qualified table recording, per outbox, the
// broker.kind its relays forward to.
func (t Tables) BrokersTable() string { return t.qualify("millrace_outbox_brokers") }

func (t Tables) brokerStatements() []string {
	return []string{`CREATE TABLE IF NOT EXISTS ` + t.BrokersTable() + ` (
	outbox_topic TEXT PRIMARY KEY,
	broker_kind TEXT NOT NULL,
	recorded_at TIMESTAMPTZ NOT NULL DEFAULT now()
)`}
}

// ErrBrokerChanged says that a relay or a service is configured for another
// broker.kind than the outbox's rows were written for.
var ErrBrokerChanged = errors.New("the outbox is relayed to another broker.kind")

// BrokerChangeError is the detail of ErrBrokerChanged.
type BrokerChangeError struct {
	// Recorded is the kind the outbox is relayed to (or the row was written
	// for); Wanted is the kind of the relay or service at hand.
	Recorded, Wanted string
	// Pending counts rows not forwarded yet; Offset is the outbox offset of
	// a row written for Recorded (0 when the change was refused at start).
	Pending int64
	Offset  int64
}

func (e *BrokerChangeError) Error() string {
	if e.Offset > 0 {
		return fmt.Sprintf("%v: outbox row %d was written by a service with broker.kind %q, and this relay's broker.kind is %q",
			ErrBrokerChanged, e.Offset, e.Recorded, e.Wanted)
	}
	return fmt.Sprintf("%v: the outbox is relayed to broker.kind %q with %d event(s) for it pending, and this config says %q",
		ErrBrokerChanged, e.Recorded, e.Pending, e.Wanted)
}

// Unwrap makes errors.Is(err, ErrBrokerChanged) hold.
func (e *BrokerChangeError) Unwrap() error { return ErrBrokerChanged }

// RecordedBroker returns the broker.kind the outbox is relayed to, "" when
// none is recorded yet (or the table is missing: an outbox migrated before
// it).
func (t Tables) RecordedBroker(ctx context.Context, db DBTX) (string, error) {
	return recorded(ctx, db, t, `SELECT broker_kind FROM `+t.BrokersTable(), "", "the broker")
}

// recorded reads what query (a SELECT of one column from a table with a
// row per outbox) records for t's outbox, or returns none when nothing is
// recorded (or the table is missing: an outbox migrated before it). Its
// error says it could not read what of the outbox.
func recorded[T any](ctx context.Context, db DBTX, t Tables, query string, none T, what string) (T, error) {
	v := none
	err := db.QueryRowContext(ctx, query+` WHERE outbox_topic = $1`, t.OutboxTopic).Scan(&v)
	switch {
	case errors.Is(err, sql.ErrNoRows), isUndefinedTable(err):
		return none, nil
	case err != nil:
		var zero T
		return zero, fmt.Errorf("read %s of %s: %w", what, t.OutboxTable(), err)
	}
	return v, nil
}

// RecordBroker makes kind the broker.kind the outbox is relayed to. A
// change is refused with a *BrokerChangeError while any of cursors has
// rows pending that were not written for kind. It returns the kind
// recorded before ("" when none, or kind itself).
func (t Tables) RecordBroker(ctx context.Context, db *sql.DB, kind string, cursors []Cursor) (string, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return "", fmt.Errorf("begin recording the broker: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`, "millrace broker "+t.OutboxNotifyPayload()); err != nil {
		return "", fmt.Errorf("lock the broker record: %w", err)
	}
	recorded, err := t.RecordedBroker(ctx, tx)
	if err != nil || recorded == kind {
		return recorded, err
	}
	if recorded != "" {
		pending, err := t.pendingIn(ctx, tx, cursors, kind)
		if err != nil {
			return "", err
		}
		if pending > 0 {
			return "", &BrokerChangeError{Recorded: recorded, Wanted: kind, Pending: pending}
		}
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+t.BrokersTable()+` (outbox_topic, broker_kind) VALUES ($1, $2)
		ON CONFLICT (outbox_topic) DO UPDATE SET broker_kind = excluded.broker_kind, recorded_at = now()`, t.OutboxTopic, kind); err != nil {
		return "", fmt.Errorf("record the broker of %s: %w", t.OutboxTable(), err)
	}
	if err := tx.Commit(); err != nil {
		return "", fmt.Errorf("commit the broker record: %w", err)
	}
	return recorded, nil
}

// CheckBroker returns a *BrokerChangeError when the outbox is relayed to
// another kind than kind and rows not written for kind are pending in any
// of cursors, and the recorded kind otherwise.
func (t Tables) CheckBroker(ctx context.Context, db DBTX, kind string, cursors []Cursor) (string, error) {
	recorded, err := t.RecordedBroker(ctx, db)
	if err != nil || recorded == "" || recorded == kind {
		return recorded, err
	}
	pending, err := t.pendingIn(ctx, db, cursors, kind)
	if err != nil {
		return "", err
	}
	if pending > 0 {
		return "", &BrokerChangeError{Recorded: recorded, Wanted: kind, Pending: pending}
	}
	return recorded, nil
}

// pendingIn counts the rows pending in cursors that were not written for
// kind: those written for another kind, or without a kind.
func (t Tables) pendingIn(ctx context.Context, db DBTX, cursors []Cursor, kind string) (int64, error) {
	total := int64(0)
	for _, c := range cursors {
		n, _, err := t.backlog(ctx, db, c, string(BrokerStamp(kind)))
		if err != nil {
			return 0, err
		}
		total += n
	}
	return total, nil
}

// BrokerStamp is the outbox row metadata of a row written by a service
// with broker.kind kind, byte for byte as Watermill's schema adapter
// stores it (its JSON encoding of the metadata map).
func BrokerStamp(kind string) []byte {
	stamp, _ := json.Marshal(map[string]string{BrokerKindKey: kind})
	return stamp
}

// ForeignBroker returns the broker.kind an outbox row's metadata names when
// it is another than the one stamp (BrokerStamp of the relay's own kind)
// names, and "" for a row of the relay's kind or without one (written by
// plain Watermill, or replayed). The common case, a row of the relay's own
// kind, is told without decoding.
func ForeignBroker(metadata, stamp []byte) string {
	if bytes.Equal(metadata, stamp) || !bytes.Contains(metadata, []byte(`"`+BrokerKindKey+`"`)) {
		return ""
	}
	var m map[string]string
	if err := json.Unmarshal(metadata, &m); err != nil {
		return ""
	}
	if kind := m[BrokerKindKey]; !bytes.Equal(BrokerStamp(kind), stamp) {
		return kind
	}
	return ""
}

// isUndefinedTable says whether err is PostgreSQL's undefined_table: a
// table an older Migrate did not create.
func isUndefinedTable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42P01"
}
