package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Poisoned is one message the consumer chain gave up on, with its failure
// envelope, as the poison table keeps it.
type Poisoned struct {
	ConsumerGroup  string
	Handler        string
	SourceTopic    string
	MessageID      string
	EventID        string
	EventType      string
	Payload        []byte
	Metadata       map[string]string
	Reason         string
	ErrorClass     string
	Attempts       int
	FirstFailureAt time.Time
	LastFailureAt  time.Time
	Traceparent    string
	PoisonedAt     time.Time
}

// StorePoisoned upserts p into the poison table: poisoning the same message
// (or a replay of it, whose MessageID is the original's) for the same
// consumer group and handler again refreshes its row, counts it and clears
// its replayed mark. Text PostgreSQL cannot hold (NUL, invalid UTF-8, which
// only a message from another publisher can carry) is replaced by U+FFFD.
func (t Tables) StorePoisoned(ctx context.Context, db DBTX, p Poisoned) error {
	meta := make(map[string]string, len(p.Metadata))
	for k, v := range p.Metadata {
		meta[clean(k)] = clean(v)
	}
	metaJSON, err := json.Marshal(meta)
	if err != nil {
		return fmt.Errorf("encode metadata: %w", err)
	}
	metadata := string(metaJSON) // text for the jsonb column, in every query exec mode: see jsonArgs
	payload := p.Payload
	if payload == nil {
		payload = []byte{}
	}
	_, err = db.ExecContext(ctx, `INSERT INTO `+t.PoisonTable()+` AS p
	(consumer_group, handler, source_topic, message_id, event_id, event_type, payload, metadata,
	 reason, error_class, attempts, first_failure_at, last_failure_at, traceparent, poisoned_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
ON CONFLICT (consumer_group, handler, message_id) DO UPDATE SET
	source_topic = EXCLUDED.source_topic, event_id = EXCLUDED.event_id, event_type = EXCLUDED.event_type,
	payload = EXCLUDED.payload, metadata = EXCLUDED.metadata, reason = EXCLUDED.reason,
	error_class = EXCLUDED.error_class, attempts = EXCLUDED.attempts,
	first_failure_at = EXCLUDED.first_failure_at, last_failure_at = EXCLUDED.last_failure_at,
	traceparent = EXCLUDED.traceparent, poisoned_at = EXCLUDED.poisoned_at,
	times_poisoned = p.times_poisoned + 1, replayed_at = NULL, skipped_at = NULL`,
		p.ConsumerGroup, p.Handler, p.SourceTopic, clean(p.MessageID), clean(p.EventID), clean(p.EventType),
		payload, metadata, clean(p.Reason), p.ErrorClass, p.Attempts, p.FirstFailureAt, p.LastFailureAt,
		clean(p.Traceparent), p.PoisonedAt)
	if err != nil {
		return fmt.Errorf("insert into %s: %w", t.PoisonTable(), err)
	}
	return nil
}

// clean makes s storable in a text or jsonb column.
func clean(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// TimeBound is one end of a time range: an instant, or a duration before
// the database's now. The zero TimeBound is unset.
type TimeBound struct {
	At  time.Time
	Ago time.Duration
	Set bool
}

func (b TimeBound) sql(arg func(any) string) string {
	if !b.At.IsZero() {
		return arg(b.At)
	}
	return "now() - make_interval(secs => " + arg(b.Ago.Seconds()) + ")"
}

// reasonNormalised is the SQL of a poison row's (alias p) failure reason
// reduced to what messages failing the same way share: its first line,
// with UUIDs, hexadecimal and decimal numbers replaced by placeholders and
// runs of white space by one space, at most 300 characters.
const reasonNormalised = `left(regexp_replace(regexp_replace(regexp_replace(split_part(p.reason, E'\n', 1),
	'[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}', '<uuid>', 'g'),
	'0x[0-9a-fA-F]+|[0-9a-fA-F]{16,}|[0-9]+', '<n>', 'g'), '\s+', ' ', 'g'), 300)`

// fingerprint is the SQL of a poison row's failure fingerprint: the first
// 12 hex digits of the MD5 of its error class and normalised reason.
const fingerprint = `left(md5(p.error_class || E'\x1f' || ` + reasonNormalised + `), 12)`

// FingerprintLength is the length of a failure fingerprint in hex digits.
const FingerprintLength = 12

// RowFilter is what the filters of the operators' tables (PoisonFilter,
// the relay quarantine's) select by; the zero filter selects all.
type RowFilter struct {
	IDs   []int64
	Topic string
	// Reason matches rows whose reason contains it, case-insensitively.
	Reason string
	// Since and Until bound the time a row was set aside (poisoned_at,
	// quarantined_at): Since <= it < Until.
	Since, Until TimeBound
	// Replayed, when set, selects rows replayed (true) or not replayed
	// (false) since they were set aside.
	Replayed *bool
}

// conditions returns f's SQL conditions on the table aliased alias, whose
// topic and at columns hold a row's topic and the time it was set aside,
// appending their arguments to args.
func (f RowFilter) conditions(args *[]any, alias, topic, at string) conditions {
	c := conditions{args: args}
	c.ids(alias+".id", f.IDs)
	c.equal(alias+"."+topic, f.Topic)
	c.contains(alias+".reason", f.Reason)
	c.between(alias+"."+at, f.Since, f.Until)
	c.isSet(alias+".replayed_at", f.Replayed)
	return c
}

// PoisonFilter selects rows of the poison table; the zero filter selects all.
type PoisonFilter struct {
	RowFilter
	Handler, Group string
	// Fingerprint matches rows of one failure group (PoisonGroups).
	Fingerprint string
}

// where returns the filter's SQL conditions on the poison table p,
// appending their arguments to args.
func (f PoisonFilter) where(args *[]any) []string {
	c := f.conditions(args, "p", "source_topic", "poisoned_at")
	c.equal("p.handler", f.Handler)
	c.equal("p.consumer_group", f.Group)
	c.equal(fingerprint, f.Fingerprint)
	return c.list
}

// Read says how a query reads the rows its filter selects (PoisonQuery,
// QuarantineQuery).
type Read struct {
	// NewestFirst orders by the time the row was written, descending; else
	// by id ascending.
	NewestFirst bool
	// Limit caps the rows read; 0 reads all.
	Limit int
	// Full also reads the payload and what comes with it (see the query).
	Full bool
	// Lock takes the rows FOR UPDATE (inside a transaction).
	Lock bool
}

// finish appends r's clauses to the list query b on the table aliased
// alias, with the conditions where: ordered by alias.id, or by newest
// when r.NewestFirst.
func (r Read) finish(b *strings.Builder, where []string, alias, newest string) {
	order := alias + ".id"
	if r.NewestFirst {
		order = newest
	}
	finishSelect(b, where, order, r.Limit, r.Lock, alias)
}

// finishSelect appends the WHERE, ORDER BY, LIMIT and FOR UPDATE clauses
// of a list query on the table aliased alias.
func finishSelect(b *strings.Builder, where []string, order string, limit int, lock bool, alias string) {
	if len(where) > 0 {
		b.WriteString("\nWHERE " + strings.Join(where, " AND "))
	}
	b.WriteString("\nORDER BY " + order)
	if limit > 0 {
		b.WriteString(" LIMIT " + strconv.Itoa(limit))
	}
	if lock {
		b.WriteString(" FOR UPDATE OF " + alias)
	}
}

// conditions builds the WHERE conditions of a filter and their arguments.
type conditions struct {
	args *[]any
	list []string
}

func (c *conditions) arg(v any) string {
	*c.args = append(*c.args, v)
	return "$" + strconv.Itoa(len(*c.args))
}

func (c *conditions) ids(col string, ids []int64) {
	if len(ids) > 0 {
		c.list = append(c.list, col+" = ANY("+c.arg(ids)+")")
	}
}

func (c *conditions) equal(col, v string) {
	if v != "" {
		c.list = append(c.list, col+" = "+c.arg(v))
	}
}

// contains matches text containing v, case-insensitively.
func (c *conditions) contains(col, v string) {
	if v != "" {
		c.list = append(c.list, "strpos(lower("+col+"), lower("+c.arg(v)+")) > 0")
	}
}

// between matches since <= col < until, for the bounds that are set.
func (c *conditions) between(col string, since, until TimeBound) {
	if since.Set {
		c.list = append(c.list, col+" >= "+since.sql(c.arg))
	}
	if until.Set {
		c.list = append(c.list, col+" < "+until.sql(c.arg))
	}
}

// isSet matches a set (true) or unset (false) col when set is not nil.
func (c *conditions) isSet(col string, set *bool) {
	switch {
	case set == nil:
	case *set:
		c.list = append(c.list, col+" IS NOT NULL")
	default:
		c.list = append(c.list, col+" IS NULL")
	}
}

// PoisonQuery says which poison rows to read and how. Read.NewestFirst
// orders by poisoned_at; Read.Full also reads the payload, metadata and
// traceparent.
type PoisonQuery struct {
	Filter PoisonFilter
	Read
}

// PoisonRow is a poison table row as operations report it: the failure
// envelope, how often it was replayed, and when its consumer group's inbox
// recorded the event, if it did.
type PoisonRow struct {
	ID             int64
	ConsumerGroup  string
	Handler        string
	Topic          string
	MessageID      string
	EventID        string
	EventType      string
	AggregateID    string
	ErrorClass     string
	Reason         string
	Attempts       int
	TimesPoisoned  int
	FirstFailureAt time.Time
	LastFailureAt  time.Time
	PoisonedAt     time.Time
	ReplayedAt     *time.Time
	// SkippedAt is when an operator skipped it (`millrace dlq skip`)
	// since it was last poisoned; nil otherwise.
	SkippedAt    *time.Time
	ReplayCount  int
	ProcessedAt  *time.Time
	PayloadBytes int
	Fingerprint  string
	// ReplayQuarantine is the relay quarantine's row of the last replay,
	// when the relay quarantined it and it was not replayed from there
	// since; nil otherwise.
	ReplayQuarantine *QuarantineRef

	// With PoisonQuery.Full only.
	Traceparent string
	Payload     []byte
	Metadata    map[string]string
}

// Poison reads the rows q selects.
func (t Tables) Poison(ctx context.Context, db DBTX, q PoisonQuery) ([]PoisonRow, error) {
	cols := `p.id, p.consumer_group, p.handler, p.source_topic, p.message_id, p.event_id, p.event_type,
	p.error_class, p.reason, p.attempts, p.times_poisoned, p.first_failure_at, p.last_failure_at,
	p.poisoned_at, p.replayed_at, (SELECT count(*) FROM ` + t.PoisonReplaysTable() + ` r WHERE r.poison_id = p.id),
	i.processed_at, length(p.payload), coalesce(p.metadata->>'aggregate-id', ''), ` + fingerprint + `,
	rq.id, rq.reason, rq.quarantined_at, p.skipped_at`
	if q.Full {
		cols += `, p.traceparent, p.payload, p.metadata`
	}
	var args []any
	var b strings.Builder
	b.WriteString(`SELECT ` + cols + ` FROM ` + t.PoisonTable() + ` p
	LEFT JOIN ` + t.InboxTable() + ` i ON i.consumer_group = p.consumer_group AND i.event_id = p.event_id
	LEFT JOIN LATERAL (` + t.replayQuarantine() + `) rq ON true`)
	q.finish(&b, q.Filter.where(&args), "p", "p.poisoned_at DESC, p.id DESC")
	rows, err := db.QueryContext(ctx, b.String(), args...)
	return collect(rows, err, "read "+t.PoisonTable(), func(rows *sql.Rows, r *PoisonRow) error { return r.scan(rows, q.Full) })
}

// scan reads r from the current row of a Poison query, with its payload,
// metadata and traceparent when full.
func (r *PoisonRow) scan(rows *sql.Rows, full bool) error {
	var replayed, processed, quarantinedAt, skippedAt sql.NullTime
	var quarantineID sql.NullInt64
	var quarantineReason sql.NullString
	var metadata []byte
	dest := []any{&r.ID, &r.ConsumerGroup, &r.Handler, &r.Topic, &r.MessageID, &r.EventID, &r.EventType,
		&r.ErrorClass, &r.Reason, &r.Attempts, &r.TimesPoisoned, &r.FirstFailureAt, &r.LastFailureAt,
		&r.PoisonedAt, &replayed, &r.ReplayCount, &processed, &r.PayloadBytes, &r.AggregateID, &r.Fingerprint,
		&quarantineID, &quarantineReason, &quarantinedAt, &skippedAt}
	if full {
		dest = append(dest, &r.Traceparent, &r.Payload, &metadata)
	}
	if err := rows.Scan(dest...); err != nil {
		return err
	}
	if full {
		if err := json.Unmarshal(metadata, &r.Metadata); err != nil {
			return fmt.Errorf("poison message %d: metadata is not a JSON object of strings: %w", r.ID, err)
		}
	}
	r.FirstFailureAt, r.LastFailureAt, r.PoisonedAt = r.FirstFailureAt.UTC(), r.LastFailureAt.UTC(), r.PoisonedAt.UTC()
	r.ReplayedAt, r.ProcessedAt, r.SkippedAt = utcPtr(replayed), utcPtr(processed), utcPtr(skippedAt)
	if quarantineID.Valid {
		r.ReplayQuarantine = &QuarantineRef{ID: quarantineID.Int64, Reason: quarantineReason.String, QuarantinedAt: quarantinedAt.Time.UTC()}
	}
	return nil
}

// QuarantineRef names a row of the relay quarantine and why it is there.
type QuarantineRef struct {
	ID            int64
	Reason        string
	QuarantinedAt time.Time
}

// replayQuarantine is the SQL of the quarantine row holding the last replay
// of the poison row p, if the relay quarantined it (the row's outbox uuid is
// the replay's message id) and it was not replayed from the quarantine
// since: the newest such row, while p is replayed and not poisoned again.
func (t Tables) replayQuarantine() string {
	return `SELECT q.id, q.reason, q.quarantined_at FROM ` + t.QuarantineTable() + ` q
	WHERE p.replayed_at IS NOT NULL AND q.replayed_at IS NULL AND q.outbox_uuid = (SELECT r.message_id FROM ` +
		t.PoisonReplaysTable() + ` r WHERE r.poison_id = p.id ORDER BY r.id DESC LIMIT 1)
	ORDER BY q.id DESC LIMIT 1`
}

func utcPtr(t sql.NullTime) *time.Time {
	if !t.Valid {
		return nil
	}
	u := t.Time.UTC()
	return &u
}

// PoisonReplay is one replay of a poisoned message.
type PoisonReplay struct {
	ReplayedAt    time.Time
	MessageID     string
	ReplayedBy    string
	TimesPoisoned int
}

// PoisonReplays reads the replay history of poison row id, oldest first.
func (t Tables) PoisonReplays(ctx context.Context, db DBTX, id int64) ([]PoisonReplay, error) {
	rows, err := db.QueryContext(ctx, `SELECT replayed_at, message_id, replayed_by, times_poisoned FROM `+
		t.PoisonReplaysTable()+` WHERE poison_id = $1 ORDER BY id`, id)
	return collect(rows, err, "read "+t.PoisonReplaysTable(), func(rows *sql.Rows, r *PoisonReplay) error {
		err := rows.Scan(&r.ReplayedAt, &r.MessageID, &r.ReplayedBy, &r.TimesPoisoned)
		r.ReplayedAt = r.ReplayedAt.UTC()
		return err
	})
}

// MarkPoisonReplayed sets replayed_at on the poison rows ids and records,
// for each, a replay sent as messageIDs[i] by by, in tx.
func (t Tables) MarkPoisonReplayed(ctx context.Context, tx DBTX, ids []int64, messageIDs []string, by string) error {
	if _, err := tx.ExecContext(ctx, `UPDATE `+t.PoisonTable()+` SET replayed_at = now() WHERE id = ANY($1)`, ids); err != nil {
		return fmt.Errorf("mark replayed: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+t.PoisonReplaysTable()+` (poison_id, message_id, replayed_by, times_poisoned)
SELECT p.id, m.message_id, $3, p.times_poisoned
FROM unnest($1::bigint[], $2::text[]) AS m(poison_id, message_id) JOIN `+t.PoisonTable()+` p ON p.id = m.poison_id`,
		ids, messageIDs, by); err != nil {
		return fmt.Errorf("record replay history: %w", err)
	}
	return nil
}

// ReplayedGroups returns the consumer groups, sorted, of the poison rows a
// replay sent as messageID replayed; none when the replay history has no
// such replay (the rows were purged).
func (t Tables) ReplayedGroups(ctx context.Context, db DBTX, messageID string) ([]string, error) {
	var groups sql.NullString
	err := db.QueryRowContext(ctx, `SELECT string_agg(DISTINCT p.consumer_group, ',' ORDER BY p.consumer_group)
FROM `+t.PoisonReplaysTable()+` r JOIN `+t.PoisonTable()+` p ON p.id = r.poison_id WHERE r.message_id = $1`, messageID).Scan(&groups)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", t.PoisonReplaysTable(), err)
	}
	if !groups.Valid {
		return nil, nil
	}
	return strings.Split(groups.String, ","), nil
}

// DeletePoison deletes the poison rows ids and their replay history. A
// row that holds a park is skipped first: the messages parked behind it
// flow on without it.
func (t Tables) DeletePoison(ctx context.Context, db DBTX, ids []int64) error {
	if err := t.ReleaseParks(ctx, db, ids, true); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `DELETE FROM `+t.PoisonTable()+` WHERE id = ANY($1)`, ids); err != nil {
		return fmt.Errorf("delete from %s: %w", t.PoisonTable(), err)
	}
	return nil
}

// LastPoisonReason is the failure reason of the newest poison row of
// eventID for group and handler, and whether there is one.
func (t Tables) LastPoisonReason(ctx context.Context, db DBTX, group, handler, eventID string) (string, bool, error) {
	var reason string
	err := db.QueryRowContext(ctx, `SELECT reason FROM `+t.PoisonTable()+
		` WHERE consumer_group = $1 AND handler = $2 AND event_id = $3 ORDER BY poisoned_at DESC LIMIT 1`,
		group, handler, eventID).Scan(&reason)
	if err == sql.ErrNoRows {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("read %s: %w", t.PoisonTable(), err)
	}
	return reason, true, nil
}

// PoisonGroup is one failure group of the poison table: the rows of one
// error class whose reasons normalise to the same text.
type PoisonGroup struct {
	Fingerprint string
	ErrorClass  string
	// Reason is the normalised reason; Example the newest row's own.
	Reason, Example string
	// Messages counts the group's rows; Waiting those not replayed since
	// they were last poisoned.
	Messages, Waiting int64
	// Handlers and Topics are those of the group's rows, sorted.
	Handlers, Topics []string
	FirstPoisonedAt  time.Time
	LastPoisonedAt   time.Time
}

// PoisonGroups reads the failure groups of the rows f selects, the largest
// first.
func (t Tables) PoisonGroups(ctx context.Context, db DBTX, f PoisonFilter) ([]PoisonGroup, error) {
	var args []any
	where := f.where(&args)
	cond := ""
	if len(where) > 0 {
		cond = "\nWHERE " + strings.Join(where, " AND ")
	}
	rows, err := db.QueryContext(ctx, `SELECT fp, error_class, norm, (array_agg(reason ORDER BY poisoned_at DESC, id DESC))[1],
	count(*), count(*) FILTER (WHERE replayed_at IS NULL),
	string_agg(DISTINCT handler, ',' ORDER BY handler), string_agg(DISTINCT source_topic, ',' ORDER BY source_topic),
	min(poisoned_at), max(poisoned_at)
FROM (SELECT p.id, p.error_class, p.reason, p.replayed_at, p.handler, p.source_topic, p.poisoned_at,
	`+reasonNormalised+` AS norm, `+fingerprint+` AS fp
	FROM `+t.PoisonTable()+` p`+cond+`) g
GROUP BY fp, error_class, norm
ORDER BY count(*) DESC, max(poisoned_at) DESC, fp`, args...)
	return collect(rows, err, "group "+t.PoisonTable(), func(rows *sql.Rows, g *PoisonGroup) error {
		var handlers, topics string
		err := rows.Scan(&g.Fingerprint, &g.ErrorClass, &g.Reason, &g.Example, &g.Messages, &g.Waiting,
			&handlers, &topics, &g.FirstPoisonedAt, &g.LastPoisonedAt)
		g.Handlers, g.Topics = strings.Split(handlers, ","), strings.Split(topics, ",")
		g.FirstPoisonedAt, g.LastPoisonedAt = g.FirstPoisonedAt.UTC(), g.LastPoisonedAt.UTC()
		return err
	})
}
