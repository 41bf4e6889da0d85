package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Cursor is a relay's place in the outbox: the consumer group and, when the
// outbox is split into more than one shard, the shard it reads.
type Cursor struct {
	// Group is the relay consumer group.
	Group string
	// Shard is the shard read, from 0 to Shards-1.
	Shard int
	// Shards is the number of shards; 0 or 1 is the whole outbox.
	Shards int
}

// Row is the consumer_group of c's cursor row: the group itself for the
// whole outbox, "<group>#<shard>/<shards>" for a shard.
func (c Cursor) Row() string {
	if c.Shards <= 1 {
		return c.Group
	}
	return c.Group + "#" + strconv.Itoa(c.Shard) + "/" + strconv.Itoa(c.Shards)
}

// RelayCursors are the cursors of relay group group on an outbox of shards
// shards: the group's own, or one per shard.
func RelayCursors(group string, shards int) []Cursor {
	if shards <= 1 {
		return []Cursor{{Group: group}}
	}
	cs := make([]Cursor, shards)
	for i := range cs {
		cs[i] = Cursor{Group: group, Shard: i, Shards: shards}
	}
	return cs
}

// shard is the shard c reads: 0 for the whole outbox, whose rows all have
// shard 0 since it was last resharded (RecordShards).
func (c Cursor) shard() int {
	if c.Shards <= 1 {
		return 0
	}
	return c.Shard
}

// filter is the SQL condition that keeps c's shard, after prefix ("AND ",
// "WHERE ", "AND m."), or "" for the whole outbox.
func (c Cursor) filter(prefix string) string {
	if c.Shards <= 1 {
		return ""
	}
	return prefix + "shard = " + strconv.Itoa(c.Shard)
}

// CursorsTable is the qualified table of relay cursors: per outbox and
// relay consumer group (or shard of one), the relay's position and the
// lease of the relay that forwards it.
func (t Tables) CursorsTable() string { return t.qualify("millrace_relay_cursors") }

func (t Tables) cursorStatements() []string {
	return []string{`CREATE TABLE IF NOT EXISTS ` + t.CursorsTable() + ` (
	outbox_topic TEXT NOT NULL,
	consumer_group TEXT NOT NULL,
	read_offset BIGINT NOT NULL,
	pending_xids xid8[] NOT NULL DEFAULT '{}',
	pending_done BIGINT[] NOT NULL DEFAULT '{}',
	horizon xid8 NOT NULL DEFAULT '0',
	fence BIGINT NOT NULL DEFAULT 0,
	holder TEXT NOT NULL DEFAULT '',
	lease_until TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
	holder_pid INTEGER,
	holder_backend_start TIMESTAMPTZ,
	acked_at TIMESTAMPTZ,
	PRIMARY KEY (outbox_topic, consumer_group)
)`}
}

// ErrLeaseLost is returned when a relay's lease on its cursor has passed to
// another relay (its fence no longer matches), or the cursor is not where
// the relay recorded it (see SavePosition): it must stop forwarding.
var ErrLeaseLost = errors.New("the relay's lease on its cursor passed to another relay")

// Lease is a relay's hold on a cursor. Fence is the lease's fencing token:
// every write of the relay names it, and one that finds another fence (a
// relay that took over) changes nothing.
type Lease struct {
	Cursor Cursor
	Holder string
	Fence  int64
}

// Session is a database session a lease is tied to: while a leader's
// session exists, its lease lasts until it expires; once PostgreSQL has
// closed it (the leader's process died), another relay may take the lease
// at once. Only a session on a direct connection is tied: a pooled server
// connection outlives the relay that used it.
type Session struct {
	PID   int32
	Start time.Time
}

// CurrentSession returns the session of conn.
func CurrentSession(ctx context.Context, conn DBTX) (Session, error) {
	var s Session
	err := conn.QueryRowContext(ctx, `SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()`).Scan(&s.PID, &s.Start)
	if err != nil {
		return Session{}, fmt.Errorf("read the session of the notification connection: %w", err)
	}
	return s, nil
}

// PrepareCursor makes c's cursor row exist. A new one starts where the
// group's row of watermill-sql's offsets table (the position of relays
// before this table) left off, or at the outbox's start.
func (t Tables) PrepareCursor(ctx context.Context, db DBTX, c Cursor) error {
	var exists bool
	if err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM `+t.CursorsTable()+` WHERE outbox_topic = $1 AND consumer_group = $2)`,
		t.OutboxTopic, c.Row()).Scan(&exists); err != nil || exists {
		return wrapCursor(c, "look up", err)
	}
	start := `0`
	var legacy bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.OffsetsTable()).Scan(&legacy); err != nil {
		return wrapCursor(c, "look up the offsets table for", err)
	}
	if legacy {
		start = t.legacyStart(c)
	}
	// Rows of transactions in progress may lie at or below the start:
	// every one of them is pending, from offset 0, those listed in the
	// snapshot and those from its xmax on (the horizon).
	_, err := db.ExecContext(ctx, `INSERT INTO `+t.CursorsTable()+` (outbox_topic, consumer_group, read_offset, pending_xids, pending_done, horizon)
		SELECT $1, $2, (`+start+`), coalesce(array_agg(x ORDER BY x), '{}'), coalesce(array_agg(0::bigint), '{}'),
			pg_snapshot_xmax(pg_current_snapshot())
		FROM pg_snapshot_xip(pg_current_snapshot()) x
		ON CONFLICT (outbox_topic, consumer_group) DO NOTHING`, t.OutboxTopic, c.Row())
	return wrapCursor(c, "create", err)
}

// legacyStart is an SQL expression ($2 is c.Row()) for where a cursor
// starts after a relay of watermill-sql's rule left off at (transaction
// id, offset) in the offsets table: below the first row past that
// position, every row was forwarded (that relay acked a position only below
// every open transaction), and rows written by transactions still in
// progress are pending.
func (t Tables) legacyStart(c Cursor) string {
	return `SELECT coalesce(
		(SELECT min(m."offset") - 1 FROM ` + t.OutboxTable() + ` m, ` + t.OffsetsTable() + ` o
			WHERE o.consumer_group = $2 AND (m.transaction_id, m."offset") > (o.last_processed_transaction_id, o.offset_acked) ` + c.filter("AND m.") + `),
		(SELECT max(m."offset") FROM ` + t.OutboxTable() + ` m WHERE EXISTS (SELECT 1 FROM ` + t.OffsetsTable() + ` WHERE consumer_group = $2) ` + c.filter("AND m.") + `),
		0)`
}

func wrapCursor(c Cursor, what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s the cursor of %s: %w", what, c.Row(), err)
}

// AcquireLease makes holder the relay of c for ttl, if no other relay
// holds it: its lease expired or was released, or its tied session is
// gone. It returns the lease with a new fence and the cursor's position,
// or ok false.
func (t Tables) AcquireLease(ctx context.Context, db DBTX, c Cursor, holder string, ttl time.Duration, s *Session) (l Lease, pos Position, ok bool, err error) {
	var pid sql.NullInt32
	var start sql.NullTime
	if s != nil {
		pid, start = sql.NullInt32{Int32: s.PID, Valid: true}, sql.NullTime{Time: s.Start, Valid: true}
	}
	var xids, done, horizon string
	err = db.QueryRowContext(ctx, t.relaySQL(`UPDATE `+t.CursorsTable()+` c
		SET holder = $3, fence = c.fence + 1, lease_until = clock_timestamp() + make_interval(secs => $4),
			holder_pid = $5, holder_backend_start = $6
		WHERE c.outbox_topic = $1 AND c.consumer_group = $2 AND (c.lease_until < clock_timestamp()
			OR (c.holder_pid IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a
				WHERE a.pid = c.holder_pid AND a.backend_start = c.holder_backend_start)))
		RETURNING c.fence, c.read_offset, c.pending_xids::text, c.pending_done::text, c.horizon::text`),
		t.OutboxTopic, c.Row(), holder, ttl.Seconds(), pid, start).Scan(&l.Fence, &pos.Offset, &xids, &done, &horizon)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return Lease{}, Position{}, false, nil
	case err != nil:
		return Lease{}, Position{}, false, wrapCursor(c, "take the lease of", err)
	}
	if pos.Pending, err = parsePending(xids, done); err == nil {
		pos.Horizon, err = strconv.ParseUint(horizon, 10, 64)
	}
	if err != nil {
		return Lease{}, Position{}, false, wrapCursor(c, "read", err)
	}
	l.Cursor, l.Holder = c, holder
	return l, pos, true, nil
}

// RenewLeases extends every lease of leases (all of one holder) by ttl and
// returns those that another relay has taken meanwhile.
func (t Tables) RenewLeases(ctx context.Context, db DBTX, leases []Lease, ttl time.Duration) (lost []Lease, err error) {
	if len(leases) == 0 {
		return nil, nil
	}
	rows, fences := make([]string, len(leases)), make([]string, len(leases))
	for i, l := range leases {
		rows[i], fences[i] = quoteArrayElement(l.Cursor.Row()), strconv.FormatInt(l.Fence, 10)
	}
	res, err := db.QueryContext(ctx, t.relaySQL(`UPDATE `+t.CursorsTable()+` c SET lease_until = clock_timestamp() + make_interval(secs => $2)
		FROM unnest($3::text::text[], $4::text::bigint[]) AS l(consumer_group, fence)
		WHERE c.outbox_topic = $1 AND c.consumer_group = l.consumer_group AND c.fence = l.fence
		RETURNING c.consumer_group`), t.OutboxTopic, ttl.Seconds(), "{"+strings.Join(rows, ",")+"}", "{"+strings.Join(fences, ",")+"}")
	if err != nil {
		return nil, fmt.Errorf("renew the relay's leases: %w", err)
	}
	defer res.Close()
	renewed := map[string]bool{}
	for res.Next() {
		var row string
		if err := res.Scan(&row); err != nil {
			return nil, fmt.Errorf("renew the relay's leases: %w", err)
		}
		renewed[row] = true
	}
	if err := res.Err(); err != nil {
		return nil, fmt.Errorf("renew the relay's leases: %w", err)
	}
	for _, l := range leases {
		if !renewed[l.Cursor.Row()] {
			lost = append(lost, l)
		}
	}
	return lost, nil
}

// quoteArrayElement quotes s as an element of a PostgreSQL array literal.
func quoteArrayElement(s string) string {
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s) + `"`
}

// ReleaseLease gives l up, so that a standby may take it at once, and
// NOTIFYs the standbys of the outbox (LeaseReleasedPayload).
func (t Tables) ReleaseLease(ctx context.Context, db DBTX, l Lease) error {
	_, err := db.ExecContext(ctx, t.relaySQL(`WITH released AS (
		UPDATE `+t.CursorsTable()+` SET holder = '', lease_until = '-infinity', holder_pid = NULL, holder_backend_start = NULL
		WHERE outbox_topic = $1 AND consumer_group = $2 AND fence = $3 RETURNING 1)
		SELECT pg_notify($4, $5) FROM released`), t.OutboxTopic, l.Cursor.Row(), l.Fence, NotifyChannel, t.LeaseReleasedPayload())
	return wrapCursor(l.Cursor, "release the lease of", err)
}

// LeaseReleasedPayload is the NOTIFY payload that says a relay of this
// outbox gave its lease up.
func (t Tables) LeaseReleasedPayload() string { return t.OutboxNotifyPayload() + "#released" }

// SavePosition records to as the position of l's cursor, in the relay's
// ack transaction tx, where the cursor is at from: the position the relay
// took with the lease or last recorded. It returns ErrLeaseLost when
// another relay has taken the lease, and when the cursor is elsewhere: a
// save whose COMMIT failed had committed all the same, the database has
// lost the relay's last saves (a failover to a standby that had not
// received them, a restored backup), or someone moved the cursor. Then the
// relay must start again from the cursor, not go on from its own position:
// after such a failover the outbox reuses the offsets and transaction ids
// of what it lost, below that position.
func (t Tables) SavePosition(ctx context.Context, tx DBTX, l Lease, from, to Position) error {
	xids, done := to.pendingArrays()
	fromXids, fromDone := from.pendingArrays()
	res, err := tx.ExecContext(ctx, t.relaySQL(`UPDATE `+t.CursorsTable()+`
		SET read_offset = $4, pending_xids = $5::text::xid8[], pending_done = $6::text::bigint[], horizon = $7::text::xid8, acked_at = now()
		WHERE outbox_topic = $1 AND consumer_group = $2 AND fence = $3 AND read_offset = $8
			AND pending_xids = $9::text::xid8[] AND pending_done = $10::text::bigint[] AND horizon = $11::text::xid8`),
		t.OutboxTopic, l.Cursor.Row(), l.Fence, to.Offset, xids, done, strconv.FormatUint(to.Horizon, 10),
		from.Offset, fromXids, fromDone, strconv.FormatUint(from.Horizon, 10))
	if err != nil {
		return wrapCursor(l.Cursor, "save the position of", err)
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return errors.Join(t.notSaved(ctx, tx, l, from), err)
	}
	return nil
}

// notSaved says why SavePosition changed nothing: the lease passed to
// another relay, or the cursor is not at from.
func (t Tables) notSaved(ctx context.Context, db DBTX, l Lease, from Position) error {
	var fence, offset int64
	var horizon string
	err := db.QueryRowContext(ctx, t.relaySQL(`SELECT fence, read_offset, horizon::text FROM `+t.CursorsTable()+`
		WHERE outbox_topic = $1 AND consumer_group = $2`), t.OutboxTopic, l.Cursor.Row()).Scan(&fence, &offset, &horizon)
	switch {
	case err != nil:
		return errors.Join(ErrLeaseLost, wrapCursor(l.Cursor, "read", err))
	case fence != l.Fence:
		return ErrLeaseLost
	}
	return fmt.Errorf("%w: the cursor of %s is at offset %d, horizon %s, not where this relay recorded it (%s): "+
		"its last save committed although it failed, or the database lost the relay's last saves (a failover to a standby "+
		"behind the primary), or someone moved the cursor",
		ErrLeaseLost, l.Cursor.Row(), offset, horizon, from)
}

// ReadBatch reads the next limit outbox rows of c's shard after pos, in
// offset order, in one statement and so under one snapshot, which it
// returns. The rows are: those of pos's pending transactions above their
// done offset and at or below pos.Offset (through the primary key), those
// of young transactions (from pos.Horizon on) at or below pos.Offset (a
// range scan of the primary key from the horizon, which holds the rows
// written since the read pos comes from), and those above pos.Offset (a
// range scan of the (shard, "offset") index that stops after limit rows).
// It waits for no other transaction: rows of one still in progress are
// invisible to it, and Position.Advance keeps such a transaction pending.
func (t Tables) ReadBatch(ctx context.Context, db DBTX, c Cursor, pos Position, limit int) (Batch, error) {
	xids, done := pos.pendingArrays()
	table, shard, lim := t.OutboxTable(), strconv.Itoa(c.shard()), strconv.Itoa(limit)
	cols := `m."offset", m.uuid, m.payload, m.metadata`
	rows, err := db.QueryContext(ctx, t.relaySQL(`WITH
		late AS (
			SELECT `+cols+` FROM unnest($1::text::xid8[], $2::text::bigint[]) AS p(xid, done)
			JOIN `+table+` m ON `+pendingRows("$3::bigint", shard)+` ORDER BY m."offset" LIMIT `+lim+`),
		young AS (
			SELECT m.transaction_id, `+cols+` FROM `+table+` m WHERE `+youngRows("$4::text::xid8", "$3::bigint", shard)+`),
		fresh AS (
			SELECT `+cols+` FROM `+table+` m
			WHERE m.shard = `+shard+` AND m."offset" > $3::bigint ORDER BY m."offset" LIMIT `+lim+`),
		batch AS (
			(SELECT * FROM late) UNION ALL (SELECT "offset", uuid, payload, metadata FROM young) UNION ALL (SELECT * FROM fresh)
			ORDER BY "offset" LIMIT `+lim+`)
		SELECT s.snapshot, s.young, b."offset", b.uuid, b.payload, b.metadata
		FROM (SELECT pg_current_snapshot()::text AS snapshot,
			coalesce((SELECT array_agg(DISTINCT transaction_id) FROM young), '{}')::text AS young) s
		LEFT JOIN batch b ON true
		ORDER BY b."offset"`), xids, done, pos.Offset, strconv.FormatUint(pos.Horizon, 10))
	if err != nil {
		return Batch{}, fmt.Errorf("read batch: %w", err)
	}
	return scanBatch(rows, limit)
}

// scanBatch reads the result of ReadBatch's statement.
func scanBatch(rows *sql.Rows, limit int) (Batch, error) {
	defer rows.Close()
	// Grown as rows come: most reads (a wake-up per commit at a trickle, an
	// idle poll) find a few rows or none.
	b := Batch{Rows: make([]OutboxRow, 0, min(limit, 16))}
	var snapshot, young string
	for rows.Next() {
		var r OutboxRow
		var offset sql.NullInt64
		var uuid sql.NullString
		if err := rows.Scan(&snapshot, &young, &offset, &uuid, &r.Payload, &r.Metadata); err != nil {
			return Batch{}, fmt.Errorf("scan outbox row: %w", err)
		}
		if !offset.Valid {
			continue // the row of an empty batch, carrying only the snapshot
		}
		r.Offset, r.UUID = offset.Int64, uuid.String
		b.Rows = append(b.Rows, r)
	}
	if err := rows.Err(); err != nil {
		return Batch{}, fmt.Errorf("read batch: %w", err)
	}
	var err error
	if b.Snapshot, err = ParseSnapshot(snapshot); err != nil {
		return Batch{}, fmt.Errorf("read batch: %w", err)
	}
	for _, x := range splitArray(young) {
		xid, err := strconv.ParseUint(x, 10, 64)
		if err != nil {
			return Batch{}, fmt.Errorf("read batch: young transaction %q: %w", x, err)
		}
		b.Young = append(b.Young, xid)
	}
	b.Complete = len(b.Rows) < limit
	return b, nil
}

// OutboxRow is one row of a relay batch.
type OutboxRow struct {
	Offset   int64
	UUID     string
	Payload  []byte
	Metadata []byte
}

// relaySQL tags query as a statement of this outbox's relay (of relay
// instance t.relay), so that RelayWaits finds it in pg_stat_activity
// whatever connection, pooled or not, runs it.
func (t Tables) relaySQL(query string) string {
	return "/* millrace relay " + t.OutboxNotifyPayload() + " " + t.relay + " */ " + query
}

// relayTag is the start of every tag relaySQL writes for this outbox; with
// the relay instance when t has one.
func (t Tables) relayTag() string {
	tag := "/* millrace relay " + t.OutboxNotifyPayload() + " "
	if t.relay != "" {
		tag += t.relay + " */ "
	}
	return tag
}

// Wait is a statement of a relay waiting for a lock another transaction
// holds, and that transaction.
type Wait struct {
	// Waited is how long the relay's statement has waited so far; for a
	// Commit, how long the COMMIT has.
	Waited time.Duration `json:"waited_ns"`
	// Relay is the backend pid of the waiting relay statement; 0 for a
	// Commit.
	Relay int32 `json:"relay_pid"`
	// Commit is true when the relay waits for this session's COMMIT to be
	// seen rather than for a lock: a WAL relay streams a commit as soon as
	// it is on disk, and waits until statements see its rows, which a
	// COMMIT waiting for a synchronous standby delays.
	Commit bool `json:"commit"`
	// PID, ApplicationName and State describe the blocking session
	// (pg_stat_activity); State is "idle in transaction" for a transaction
	// left open.
	PID             int32  `json:"pid"`
	ApplicationName string `json:"application_name"`
	State           string `json:"state"`
	// Age is how long the blocking transaction has been open.
	Age time.Duration `json:"age_ns"`
	// Query is the blocking session's current or last statement, "" when
	// the role reading it may not see it (only its own sessions', or with
	// pg_read_all_stats).
	Query string `json:"query"`
}

// WaitReported is how long a relay statement waits for another
// transaction's lock before RelayWaits reports it: shorter waits are the
// relay's own statements passing each other by.
const WaitReported = time.Second

// RelayWaits lists the statements of this outbox's relays (of relay
// instance t.relay alone, for Tables from ForRelay) that have waited
// WaitReported or longer for a lock, in their own sessions or on the
// pooled server connections running them, with each transaction holding
// it, longest waits first. With streamed (relay.source: wal) it lists too
// the sessions whose COMMIT of outbox rows has waited WaitReported or
// longer for synchronous replication (wait event SyncRep, the outbox's
// lock still held): the relay has their rows and waits until they are
// seen (AwaitVisible).
func (t Tables) RelayWaits(ctx context.Context, db DBTX, streamed bool) ([]Wait, error) {
	rows, err := db.QueryContext(ctx, `SELECT w.pid, extract(epoch FROM clock_timestamp() - w.query_start)::float8,
			b.pid, coalesce(b.application_name, ''), coalesce(b.state, ''),
			coalesce(extract(epoch FROM clock_timestamp() - b.xact_start), 0)::float8,
			CASE WHEN b.query = '<insufficient privilege>' THEN '' ELSE coalesce(b.query, '') END, false
		FROM pg_stat_activity w
		CROSS JOIN LATERAL unnest(pg_blocking_pids(w.pid)) AS blocking(pid)
		JOIN pg_stat_activity b ON b.pid = blocking.pid
		WHERE w.wait_event_type = 'Lock' AND starts_with(w.query, $1)
		  AND w.query_start <= clock_timestamp() - make_interval(secs => $2)
		UNION ALL
		SELECT 0, extract(epoch FROM clock_timestamp() - c.query_start)::float8,
			c.pid, coalesce(c.application_name, ''), coalesce(c.state, '') || ', its COMMIT waiting for synchronous replication',
			coalesce(extract(epoch FROM clock_timestamp() - c.xact_start), 0)::float8,
			CASE WHEN c.query = '<insufficient privilege>' THEN '' ELSE coalesce(c.query, '') END, true
		FROM pg_stat_activity c
		WHERE $3 AND c.wait_event = 'SyncRep' AND c.query_start <= clock_timestamp() - make_interval(secs => $2)
		  AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = c.pid AND l.relation = to_regclass($4))
		ORDER BY 2 DESC, 3`, t.relayTag(), WaitReported.Seconds(), streamed, t.OutboxTable())
	return collect(rows, err, "look up what the relay waits on", func(rows *sql.Rows, w *Wait) error {
		var waited, age float64
		err := rows.Scan(&w.Relay, &waited, &w.PID, &w.ApplicationName, &w.State, &age, &w.Query, &w.Commit)
		w.Waited, w.Age = seconds(waited), seconds(age)
		return err
	})
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// String says what w is, for logs and health details: "pid 4242
// (app billing, idle in transaction, open 45s): UPDATE ...".
func (w Wait) String() string {
	s := fmt.Sprintf("pid %d (application %q, %s, open %s)", w.PID, w.ApplicationName, w.State, w.Age.Round(time.Second))
	if w.Query != "" {
		q := strings.Join(strings.Fields(w.Query), " ")
		if len(q) > 200 {
			q = q[:200] + "..."
		}
		s += ": " + q
	}
	return s
}
