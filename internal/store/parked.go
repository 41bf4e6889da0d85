package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Parked aggregates. When an ordered handler poisons a message of order key
// K (an aggregate, or a saga's correlation id), K is parked for the
// handler's consumer group: a row in the parks table, held by the poison
// row. Later messages of K are appended to the parked table instead of
// being handled; the poisoned message itself is the head of that list,
// marked held. Replaying the poison row clears the mark and releases the
// park; skipping it deletes the head and releases the park. A consumer of
// the group then drains the released park under a lease, in list order,
// and deletes the park once its list is empty. Every change to a park's
// list happens under the park row's lock, so a message appended while the
// park drains lands behind the others and the park is never deleted with a
// message in it.

// Park states.
const (
	// ParkHeld is a park whose poisoned message waits for the operator.
	ParkHeld = "held"
	// ParkReleased is a park whose poisoned message was replayed or
	// skipped: a consumer drains it.
	ParkReleased = "released"
)

// ParksTable is the qualified table of parked order keys, one row per
// consumer group, handler and key.
func (t Tables) ParksTable() string { return t.qualify("millrace_parks") }

// ParkedTable is the qualified table of the messages held behind a park,
// in order (pos).
func (t Tables) ParkedTable() string { return t.qualify("millrace_parked") }

// parkedPosSequence is the qualified sequence that orders appended parked
// messages: a value is taken under the park row's lock, so the values of
// one key follow the order of the appends (a subquery on the table would
// read a snapshot older than the lock).
func (t Tables) parkedPosSequence() string { return t.qualify("millrace_parked_pos") }

// parkStatements create the parks and parked tables, and the poison
// table's skipped mark.
func (t Tables) parkStatements() []string {
	return []string{
		column(t.PoisonTable(), "skipped_at", `TIMESTAMPTZ`),
		`CREATE TABLE IF NOT EXISTS ` + t.ParksTable() + ` (
	consumer_group TEXT NOT NULL,
	handler TEXT NOT NULL,
	order_key TEXT NOT NULL,
	topic TEXT NOT NULL,
	state TEXT NOT NULL,
	poison_id BIGINT,
	parked_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	released_at TIMESTAMPTZ,
	lease_owner TEXT,
	lease_until TIMESTAMPTZ,
	PRIMARY KEY (consumer_group, handler, order_key)
)`,
		`CREATE SEQUENCE IF NOT EXISTS ` + t.parkedPosSequence(),
		t.index("millrace_parks_poison_id", t.ParksTable(), `(poison_id)`),
		`CREATE TABLE IF NOT EXISTS ` + t.ParkedTable() + ` (
	id BIGSERIAL PRIMARY KEY,
	consumer_group TEXT NOT NULL,
	handler TEXT NOT NULL,
	order_key TEXT NOT NULL,
	pos BIGINT NOT NULL,
	message_id TEXT NOT NULL,
	payload BYTEA NOT NULL,
	metadata BYTEA NOT NULL,
	held BOOLEAN NOT NULL DEFAULT false,
	parked_at TIMESTAMPTZ NOT NULL DEFAULT now()
)`,
		t.index("millrace_parked_key_pos", t.ParkedTable(), `(consumer_group, handler, order_key, pos)`),
	}
}

// ParkKey names one parked order key.
type ParkKey struct {
	Group, Handler, Key string
}

// clean makes k's order key storable in a text column (see clean): an
// order key taken from a header another publisher set may hold a NUL.
func (k ParkKey) clean() ParkKey {
	k.Key = clean(k.Key)
	return k
}

// ParkedMessage is one message held behind a park, byte for byte.
type ParkedMessage struct {
	ID        int64
	MessageID string
	Payload   []byte
	Metadata  map[string]string
}

// EncodeMetadata encodes metadata byte for byte (NUL bytes and invalid
// UTF-8 included, which jsonb cannot hold): a JSON array of [key, value]
// pairs of base64 strings, sorted by key.
func EncodeMetadata(metadata map[string]string) []byte {
	keys := make([]string, 0, len(metadata))
	for k := range metadata {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	pairs := make([][2][]byte, len(keys))
	for i, k := range keys {
		pairs[i] = [2][]byte{[]byte(k), []byte(metadata[k])}
	}
	out, _ := json.Marshal(pairs) // byte slices always encode
	return out
}

// DecodeMetadata decodes what EncodeMetadata encoded.
func DecodeMetadata(b []byte) (map[string]string, error) {
	var pairs [][2][]byte
	if err := json.Unmarshal(b, &pairs); err != nil {
		return nil, fmt.Errorf("parked metadata: %w", err)
	}
	out := make(map[string]string, len(pairs))
	for _, p := range pairs {
		out[string(p[0])] = string(p[1])
	}
	return out, nil
}

// Appended is what AppendParked did with a message.
type Appended int

// What AppendParked did.
const (
	// NotParked: the key is not parked; the message goes to the handler.
	NotParked Appended = iota
	// Parked: the message was appended to its key's parked list.
	Parked
	// SkippedMessage: an operator skipped this very message (a redelivery
	// of it, whose ack a crash lost); it is to be acked and dropped.
	SkippedMessage
)

// AppendParked appends msg to k's parked list when k is parked, in one
// statement that locks the park row, and says what it did. A message of
// k's group and handler whose poison row was skipped is neither appended
// nor to be handled.
func (t Tables) AppendParked(ctx context.Context, db DBTX, k ParkKey, msg ParkedMessage) (Appended, error) {
	k = k.clean()
	var skipped, parked bool
	err := db.QueryRowContext(ctx, `WITH s AS (SELECT EXISTS (SELECT 1 FROM `+t.PoisonTable()+`
	WHERE consumer_group = $1 AND handler = $2 AND message_id = $7 AND skipped_at IS NOT NULL) AS skipped),
p AS (SELECT consumer_group, handler, order_key FROM `+t.ParksTable()+`
	WHERE consumer_group = $1 AND handler = $2 AND order_key = $3 FOR UPDATE),
ins AS (INSERT INTO `+t.ParkedTable()+` (consumer_group, handler, order_key, pos, message_id, payload, metadata)
	SELECT p.consumer_group, p.handler, p.order_key, nextval('`+t.parkedPosSequence()+`'), $4, $5, $6
	FROM p, s WHERE NOT s.skipped RETURNING id)
SELECT s.skipped, EXISTS (SELECT 1 FROM ins) FROM s`,
		k.Group, k.Handler, k.Key, msg.MessageID, nonNil(msg.Payload), EncodeMetadata(msg.Metadata), clean(msg.MessageID)).
		Scan(&skipped, &parked)
	switch {
	case err != nil:
		return NotParked, fmt.Errorf("append to %s: %w", t.ParkedTable(), err)
	case skipped:
		return SkippedMessage, nil
	case parked:
		return Parked, nil
	}
	return NotParked, nil
}

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// StorePoisonedParked stores p in the poison table and parks k behind it,
// in tx: the park is held by p's row, and msg (p's message as it arrived)
// is the held head of k's list. When msg is already in the list (a parked
// message poisoned again while its park drained) it is marked held where
// it is, the head.
func (t Tables) StorePoisonedParked(ctx context.Context, tx DBTX, p Poisoned, k ParkKey, msg ParkedMessage) error {
	k = k.clean()
	if err := t.StorePoisoned(ctx, tx, p); err != nil {
		return err
	}
	var poisonID int64
	if err := tx.QueryRowContext(ctx, `SELECT id FROM `+t.PoisonTable()+` WHERE consumer_group = $1 AND handler = $2 AND message_id = $3`,
		p.ConsumerGroup, p.Handler, clean(p.MessageID)).Scan(&poisonID); err != nil {
		return fmt.Errorf("read %s: %w", t.PoisonTable(), err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+t.ParksTable()+` AS k (consumer_group, handler, order_key, topic, state, poison_id)
VALUES ($1, $2, $3, $4, '`+ParkHeld+`', $5)
ON CONFLICT (consumer_group, handler, order_key) DO UPDATE SET
	state = '`+ParkHeld+`', poison_id = EXCLUDED.poison_id, released_at = NULL, lease_owner = NULL, lease_until = NULL`,
		k.Group, k.Handler, k.Key, p.SourceTopic, poisonID); err != nil {
		return fmt.Errorf("park in %s: %w", t.ParksTable(), err)
	}
	res, err := tx.ExecContext(ctx, `UPDATE `+t.ParkedTable()+` SET held = true WHERE id = (
	SELECT id FROM `+t.ParkedTable()+` WHERE consumer_group = $1 AND handler = $2 AND order_key = $3 AND message_id = $4
	ORDER BY pos LIMIT 1)`, k.Group, k.Handler, k.Key, msg.MessageID)
	if err != nil {
		return fmt.Errorf("hold in %s: %w", t.ParkedTable(), err)
	}
	if n, _ := res.RowsAffected(); n > 0 {
		return nil
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+t.ParkedTable()+` (consumer_group, handler, order_key, pos, message_id, payload, metadata, held)
SELECT $1, $2, $3, coalesce(min(pos), 1) - 1, $4, $5, $6, true FROM `+t.ParkedTable()+`
WHERE consumer_group = $1 AND handler = $2 AND order_key = $3`,
		k.Group, k.Handler, k.Key, msg.MessageID, nonNil(msg.Payload), EncodeMetadata(msg.Metadata)); err != nil {
		return fmt.Errorf("insert into %s: %w", t.ParkedTable(), err)
	}
	return nil
}

// ClaimParks takes the lease of up to limit released parks of group and
// handler that no live lease holds, for owner until ttl from now, and
// returns their keys, the longest released first.
func (t Tables) ClaimParks(ctx context.Context, db DBTX, group, handler, owner string, ttl time.Duration, limit int) ([]string, error) {
	rows, err := db.QueryContext(ctx, `UPDATE `+t.ParksTable()+` k SET lease_owner = $3, lease_until = now() + make_interval(secs => $4)
FROM (SELECT order_key FROM `+t.ParksTable()+`
	WHERE consumer_group = $1 AND handler = $2 AND state = '`+ParkReleased+`' AND (lease_until IS NULL OR lease_until < now())
	ORDER BY released_at LIMIT $5 FOR UPDATE SKIP LOCKED) c
WHERE k.consumer_group = $1 AND k.handler = $2 AND k.order_key = c.order_key
RETURNING k.order_key`, group, handler, owner, ttl.Seconds(), limit)
	return collect(rows, err, "claim "+t.ParksTable(), func(rows *sql.Rows, k *string) error { return rows.Scan(k) })
}

// NextParked renews owner's lease of k's released park for ttl and
// returns the first message of its list; nil when owner holds no lease of
// k's released park (it was parked again, or another consumer took it
// over) or the list is empty.
func (t Tables) NextParked(ctx context.Context, db DBTX, k ParkKey, owner string, ttl time.Duration) (*ParkedMessage, bool, error) {
	k = k.clean()
	res, err := db.ExecContext(ctx, `UPDATE `+t.ParksTable()+` SET lease_until = now() + make_interval(secs => $5)
WHERE consumer_group = $1 AND handler = $2 AND order_key = $3 AND state = '`+ParkReleased+`' AND lease_owner = $4`,
		k.Group, k.Handler, k.Key, owner, ttl.Seconds())
	if err != nil {
		return nil, false, fmt.Errorf("renew lease in %s: %w", t.ParksTable(), err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return nil, false, nil
	}
	var m ParkedMessage
	var meta []byte
	err = db.QueryRowContext(ctx, `SELECT id, message_id, payload, metadata FROM `+t.ParkedTable()+`
WHERE consumer_group = $1 AND handler = $2 AND order_key = $3 ORDER BY pos LIMIT 1`, k.Group, k.Handler, k.Key).
		Scan(&m.ID, &m.MessageID, &m.Payload, &meta)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil, true, nil
	case err != nil:
		return nil, true, fmt.Errorf("read %s: %w", t.ParkedTable(), err)
	}
	if m.Metadata, err = DecodeMetadata(meta); err != nil {
		return nil, true, fmt.Errorf("parked message %d: %w", m.ID, err)
	}
	return &m, true, nil
}

// DoneParked deletes the parked message id once it was handled, unless it
// was poisoned again meanwhile (then it is its park's held head).
func (t Tables) DoneParked(ctx context.Context, db DBTX, id int64) error {
	if _, err := db.ExecContext(ctx, `DELETE FROM `+t.ParkedTable()+` WHERE id = $1 AND NOT held`, id); err != nil {
		return fmt.Errorf("delete from %s: %w", t.ParkedTable(), err)
	}
	return nil
}

// FinishPark deletes k's released park when owner holds its lease and its
// list is empty, and reports whether it did. It locks the park row first,
// so a message appended meanwhile is seen and keeps the park.
func (t Tables) FinishPark(ctx context.Context, db *sql.DB, k ParkKey, owner string) (bool, error) {
	k = k.clean()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return false, fmt.Errorf("finish park: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	var one int
	err = tx.QueryRowContext(ctx, `SELECT 1 FROM `+t.ParksTable()+`
WHERE consumer_group = $1 AND handler = $2 AND order_key = $3 AND state = '`+ParkReleased+`' AND lease_owner = $4 FOR UPDATE`,
		k.Group, k.Handler, k.Key, owner).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("finish park: %w", err)
	}
	res, err := tx.ExecContext(ctx, `DELETE FROM `+t.ParksTable()+` k
WHERE consumer_group = $1 AND handler = $2 AND order_key = $3 AND NOT EXISTS (SELECT 1 FROM `+t.ParkedTable()+` r
	WHERE r.consumer_group = $1 AND r.handler = $2 AND r.order_key = $3)`, k.Group, k.Handler, k.Key)
	if err != nil {
		return false, fmt.Errorf("finish park: %w", err)
	}
	n, _ := res.RowsAffected()
	return n > 0, tx.Commit()
}

// DropLeases gives up owner's leases of group and handler's parks, so that
// another consumer drains them at once.
func (t Tables) DropLeases(ctx context.Context, db DBTX, group, handler, owner string) error {
	if _, err := db.ExecContext(ctx, `UPDATE `+t.ParksTable()+` SET lease_owner = NULL, lease_until = NULL
WHERE consumer_group = $1 AND handler = $2 AND lease_owner = $3`, group, handler, owner); err != nil {
		return fmt.Errorf("drop leases in %s: %w", t.ParksTable(), err)
	}
	return nil
}

// CountParks counts group and handler's parks, held or released.
func (t Tables) CountParks(ctx context.Context, db DBTX, group, handler string) (int, error) {
	var n int
	err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+t.ParksTable()+` WHERE consumer_group = $1 AND handler = $2`,
		group, handler).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count %s: %w", t.ParksTable(), err)
	}
	return n, nil
}

// HeldParks returns, of the poison rows ids, those that hold a park.
func (t Tables) HeldParks(ctx context.Context, db DBTX, ids []int64) (map[int64]bool, error) {
	rows, err := db.QueryContext(ctx, `SELECT poison_id FROM `+t.ParksTable()+` WHERE state = '`+ParkHeld+`' AND poison_id = ANY($1) FOR UPDATE`, ids)
	return collectSet(rows, err, "read "+t.ParksTable(), len(ids))
}

// ReleaseParks releases the parks the poison rows ids hold, in tx. With
// skip the held head (the poisoned message) and any copy of it in the list
// are deleted and the rows are marked skipped; without, the head stays
// first and is drained like the others (a replay that needs no broker
// round trip).
func (t Tables) ReleaseParks(ctx context.Context, tx DBTX, ids []int64, skip bool) error {
	// A skip deletes the head and every copy of it in the list: a
	// redelivery of the poisoned message (its ack lost in a crash) is
	// parked behind it, and must not take effect either.
	head := `UPDATE ` + t.ParkedTable() + ` r SET held = false FROM ` + t.ParksTable() + ` k
WHERE r.held AND `
	if skip {
		head = `DELETE FROM ` + t.ParkedTable() + ` r USING ` + t.ParksTable() + ` k, ` + t.ParkedTable() + ` h
WHERE h.held AND h.consumer_group = k.consumer_group AND h.handler = k.handler AND h.order_key = k.order_key
	AND r.message_id = h.message_id AND `
	}
	if _, err := tx.ExecContext(ctx, head+`k.state = '`+ParkHeld+`' AND k.poison_id = ANY($1)
	AND r.consumer_group = k.consumer_group AND r.handler = k.handler AND r.order_key = k.order_key`, ids); err != nil {
		return fmt.Errorf("release the held messages of %s: %w", t.ParkedTable(), err)
	}
	if _, err := tx.ExecContext(ctx, `UPDATE `+t.ParksTable()+` SET state = '`+ParkReleased+`', released_at = now(),
	lease_owner = NULL, lease_until = NULL WHERE state = '`+ParkHeld+`' AND poison_id = ANY($1)`, ids); err != nil {
		return fmt.Errorf("release %s: %w", t.ParksTable(), err)
	}
	if !skip {
		return nil
	}
	return t.MarkPoisonSkipped(ctx, tx, ids)
}

// MarkPoisonSkipped sets skipped_at on the poison rows ids.
func (t Tables) MarkPoisonSkipped(ctx context.Context, tx DBTX, ids []int64) error {
	if _, err := tx.ExecContext(ctx, `UPDATE `+t.PoisonTable()+` SET skipped_at = now() WHERE id = ANY($1)`, ids); err != nil {
		return fmt.Errorf("mark skipped: %w", err)
	}
	return nil
}

// Park is one parked order key as operations list it.
type Park struct {
	ParkKey
	Topic string
	// State is ParkHeld or ParkReleased.
	State string
	// PoisonID is the poison row holding the park.
	PoisonID int64
	// Parked counts the messages held behind it, the poisoned one
	// included while it waits.
	Parked     int
	ParkedAt   time.Time
	ReleasedAt *time.Time
	// LeaseOwner is the consumer draining a released park; "" when none.
	LeaseOwner string
}

// ParkFilter selects parks; the zero filter selects all.
type ParkFilter struct {
	Group, Handler, Key, State string
}

// Parks lists the parks f selects, oldest first, at most limit (0: all).
func (t Tables) Parks(ctx context.Context, db DBTX, f ParkFilter, limit int) ([]Park, error) {
	var args []any
	c := conditions{args: &args}
	c.equal("k.consumer_group", f.Group)
	c.equal("k.handler", f.Handler)
	c.equal("k.order_key", f.Key)
	c.equal("k.state", f.State)
	var b strings.Builder
	b.WriteString(`SELECT k.consumer_group, k.handler, k.order_key, k.topic, k.state, coalesce(k.poison_id, 0),
	(SELECT count(*) FROM ` + t.ParkedTable() + ` r WHERE r.consumer_group = k.consumer_group AND r.handler = k.handler
		AND r.order_key = k.order_key), k.parked_at, k.released_at, coalesce(k.lease_owner, '')
FROM ` + t.ParksTable() + ` k`)
	finishSelect(&b, c.list, "k.parked_at, k.order_key", limit, false, "k")
	rows, err := db.QueryContext(ctx, b.String(), args...)
	return collect(rows, err, "read "+t.ParksTable(), func(rows *sql.Rows, p *Park) error {
		var released sql.NullTime
		err := rows.Scan(&p.Group, &p.Handler, &p.Key, &p.Topic, &p.State, &p.PoisonID, &p.Parked,
			&p.ParkedAt, &released, &p.LeaseOwner)
		p.ParkedAt, p.ReleasedAt = p.ParkedAt.UTC(), utcPtr(released)
		return err
	})
}
