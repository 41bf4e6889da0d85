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

// MaxShards bounds relay.shards: the shard column is a smallint, and every
// shard costs a cursor row, a lease and a fallback poll.
const MaxShards = 256

// ShardsTable is the qualified table recording, per outbox, the shard count
// its shard column is written with.
func (t Tables) ShardsTable() string { return t.qualify("millrace_relay_shards") }

// InstancesTable is the qualified registry of running sharded relays: one
// row per instance, with its heartbeat and, when it has one, the session
// of its direct notification connection.
func (t Tables) InstancesTable() string { return t.qualify("millrace_relay_instances") }

func (t Tables) shardFunction() string { return t.qualify("millrace_shard_" + t.OutboxTopic) }

// shardStatements is the DDL of sharding: the outbox's shard column, the
// trigger that sets it, its index, the count table and the registry.
func (t Tables) shardStatements() []string {
	outbox := t.OutboxTable()
	return []string{
		// Asked first: ADD COLUMN IF NOT EXISTS still locks the outbox
		// against writers when the column exists.
		`DO $$ BEGIN
	IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '` + outbox + `'::regclass AND attname = 'shard' AND NOT attisdropped) THEN
		ALTER TABLE ` + outbox + ` ADD COLUMN shard smallint NOT NULL DEFAULT 0;
	END IF;
END $$`,
		// The relay reads in offset order: this index serves it and the
		// count of a shard's backlog; the primary key finds a transaction's
		// rows. The index of the relay's earlier rule, by transaction id, goes.
		t.index("watermill_"+t.OutboxTopic+"_offset", outbox, `(shard, "offset")`),
		`DROP INDEX IF EXISTS "` + t.Schema + `".watermill_` + t.OutboxTopic + `_shard`,
		`CREATE TABLE IF NOT EXISTS ` + t.ShardsTable() + ` (
	outbox_topic TEXT PRIMARY KEY,
	shards INTEGER NOT NULL CHECK (shards BETWEEN 1 AND ` + strconv.Itoa(MaxShards) + `),
	recorded_at TIMESTAMPTZ NOT NULL DEFAULT now()
)`,
		`CREATE TABLE IF NOT EXISTS ` + t.InstancesTable() + ` (
	consumer_group TEXT NOT NULL,
	instance_id TEXT NOT NULL,
	pid INTEGER,
	backend_start TIMESTAMPTZ,
	started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	heartbeat_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	PRIMARY KEY (consumer_group, instance_id)
)`,
		// The session columns were NOT NULL while leadership was a session
		// lock: a relay without a direct connection has no session to tie.
		ifMissing(`SELECT 1 FROM pg_attribute WHERE attrelid = '`+t.InstancesTable()+`'::regclass AND attname = 'pid' AND NOT attnotnull`,
			`ALTER TABLE `+t.InstancesTable()+` ALTER COLUMN pid DROP NOT NULL, ALTER COLUMN backend_start DROP NOT NULL`),
		// The shard of a row is computed here, by PostgreSQL, so that every
		// writer (Watermill's own publisher included) and every relay agree.
		// One shard (no row in the count table) skips the hash. The count is
		// read by a statement of its own, with a fresh snapshot, so rows
		// inserted after a change of the count get the new one.
		`CREATE OR REPLACE FUNCTION ` + t.shardFunction() + `() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
	n integer;
	agg text;
BEGIN
	SELECT shards INTO n FROM ` + t.ShardsTable() + ` WHERE outbox_topic = '` + t.OutboxTopic + `';
	IF n IS NULL OR n <= 1 THEN
		NEW.shard := 0;
		RETURN NEW;
	END IF;
	agg := NEW.payload::json -> 'metadata' ->> 'aggregate-id';
	IF agg IS NULL OR agg = '' THEN
		NEW.shard := 0;
	ELSE
		NEW.shard := ((hashtextextended(agg, 0) % n) + n) % n;
	END IF;
	-- The notification names the shard, so that it wakes only the relay
	-- of that shard; PostgreSQL folds the duplicates of a transaction.
	PERFORM pg_notify('` + NotifyChannel + `', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME || '/' || NEW.shard);
	RETURN NEW;
END $$`,
		trigger("millrace_shard", "BEFORE INSERT", outbox, "ROW", t.shardFunction()),
	}
}

// ErrShardsChanged is returned by RecordShards when the shard count differs
// from the one the outbox's pending rows were written with.
var ErrShardsChanged = errors.New("the outbox has rows pending under another shard count")

// ShardsChangeError is the detail of ErrShardsChanged.
type ShardsChangeError struct {
	// Recorded is the count the outbox was written with; Wanted is the new one.
	Recorded, Wanted int
	// Pending counts the group's rows not forwarded yet under Recorded.
	Pending int64
}

func (e *ShardsChangeError) Error() string {
	return fmt.Sprintf("%v: %d rows pending under %d shards, started with %d", ErrShardsChanged, e.Pending, e.Recorded, e.Wanted)
}

// Unwrap makes errors.Is(err, ErrShardsChanged) hold.
func (e *ShardsChangeError) Unwrap() error { return ErrShardsChanged }

// RecordedShards returns the shard count the outbox is written with: 1
// until RecordShards recorded another, and 1 when the count table is
// missing (an outbox migrated before shards, which has only shard 0).
func (t Tables) RecordedShards(ctx context.Context, db DBTX) (int, error) {
	return recorded(ctx, db, t, `SELECT shards FROM `+t.ShardsTable(), 1, "the shard count")
}

// RecordShards makes n the outbox's shard count for group, if it is not
// already. A change is refused with a *ShardsChangeError while group has
// rows pending under the recorded count. Otherwise, with the outbox locked
// against writers (a writer in flight commits first; the next waits), it
// records n, so the trigger shards every row inserted after it by n, and
// starts each cursor of the new count past every row in the outbox: each
// of them was forwarded, and no transaction in progress holds an outbox
// row (the lock waited for them), so every row written later has a higher
// offset. Rows already written keep their shard value; nothing is
// rewritten.
func (t Tables) RecordShards(ctx context.Context, db *sql.DB, group string, n int) error {
	if n < 1 || n > MaxShards {
		return fmt.Errorf("shard count %d: must be from 1 to %d", n, MaxShards)
	}
	if recorded, err := t.RecordedShards(ctx, db); err != nil || recorded == n {
		return err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin the shard count change: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`, "millrace shards "+t.OutboxNotifyPayload()); err != nil {
		return fmt.Errorf("lock the shard count: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `LOCK TABLE `+t.OutboxTable()+` IN SHARE MODE`); err != nil {
		return fmt.Errorf("lock %s against writers: %w", t.OutboxTable(), err)
	}
	recorded, err := t.RecordedShards(ctx, tx)
	if err != nil || recorded == n {
		return err
	}
	pending := int64(0)
	for i := range recorded {
		p, _, err := t.Backlog(ctx, tx, Cursor{Group: group, Shard: i, Shards: recorded})
		if err != nil {
			return err
		}
		pending += p
	}
	if pending > 0 {
		return &ShardsChangeError{Recorded: recorded, Wanted: n, Pending: pending}
	}
	if _, err := tx.ExecContext(ctx, `
		INSERT INTO `+t.CursorsTable()+` (outbox_topic, consumer_group, read_offset, horizon)
		SELECT $1, r, (SELECT coalesce(max("offset"), 0) FROM `+t.OutboxTable()+`), pg_snapshot_xmax(pg_current_snapshot())
		FROM unnest($2::text::text[]) r
		ON CONFLICT (outbox_topic, consumer_group) DO UPDATE
		SET read_offset = excluded.read_offset, pending_xids = '{}', pending_done = '{}', horizon = excluded.horizon`,
		t.OutboxTopic, cursorRows(group, n)); err != nil {
		return fmt.Errorf("start the cursors of %d shards: %w", n, err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+t.ShardsTable()+` (outbox_topic, shards) VALUES ($1, $2)
		ON CONFLICT (outbox_topic) DO UPDATE SET shards = excluded.shards, recorded_at = now()`, t.OutboxTopic, n); err != nil {
		return fmt.Errorf("record the shard count: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit the shard count change: %w", err)
	}
	return nil
}

// cursorRows is the array literal of the cursor rows of group's n shards.
func cursorRows(group string, n int) string {
	rows := make([]string, n)
	for i := range rows {
		rows[i] = quoteArrayElement(Cursor{Group: group, Shard: i, Shards: n}.Row())
	}
	return "{" + strings.Join(rows, ",") + "}"
}

// Heartbeat registers instance id of group, or renews its heartbeat, with
// the session of its direct notification connection when it has one.
func (t Tables) Heartbeat(ctx context.Context, db DBTX, group, id string, s *Session) error {
	var pid sql.NullInt32
	var start sql.NullTime
	if s != nil {
		pid, start = sql.NullInt32{Int32: s.PID, Valid: true}, sql.NullTime{Time: s.Start, Valid: true}
	}
	_, err := db.ExecContext(ctx, `INSERT INTO `+t.InstancesTable()+` (consumer_group, instance_id, pid, backend_start)
		VALUES ($1, $2, $3, $4)
		ON CONFLICT (consumer_group, instance_id) DO UPDATE
		SET pid = excluded.pid, backend_start = excluded.backend_start, heartbeat_at = now()`, group, id, pid, start)
	if err != nil {
		return fmt.Errorf("relay heartbeat: %w", err)
	}
	return nil
}

// Unregister removes instance id of group from the registry.
func (t Tables) Unregister(ctx context.Context, db DBTX, group, id string) error {
	if _, err := db.ExecContext(ctx, `DELETE FROM `+t.InstancesTable()+` WHERE consumer_group = $1 AND instance_id = $2`, group, id); err != nil {
		return fmt.Errorf("unregister relay %s: %w", id, err)
	}
	return nil
}

// LiveInstances deletes the registry rows of group whose heartbeat is older
// than ttl or whose tied session is gone, and counts the others. A killed
// relay's row goes at once when it had a direct notification connection,
// else once its heartbeat is ttl old.
func (t Tables) LiveInstances(ctx context.Context, db DBTX, group string, ttl time.Duration) (int, error) {
	var n int
	err := db.QueryRowContext(ctx, `
		WITH gone AS (
			DELETE FROM `+t.InstancesTable()+` i WHERE i.consumer_group = $1
			AND (i.heartbeat_at < now() - make_interval(secs => $2) OR (i.pid IS NOT NULL AND NOT EXISTS (
				SELECT 1 FROM pg_stat_activity a WHERE a.pid = i.pid AND a.backend_start = i.backend_start)))
			RETURNING instance_id)
		SELECT count(*) FROM `+t.InstancesTable()+` WHERE consumer_group = $1
			AND instance_id NOT IN (SELECT instance_id FROM gone)`, group, ttl.Seconds()).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count live relays: %w", err)
	}
	return n, nil
}

// shardOwners is a CTE "s" of the n shards of group with the holder of
// each one's live lease (” when none): $1 is the outbox topic, $2 group,
// $3 n.
func (t Tables) shardOwners() string {
	return `s AS (
		SELECT i AS shard, coalesce((SELECT c.holder FROM ` + t.CursorsTable() + ` c
			WHERE c.outbox_topic = $1 AND c.consumer_group = $2 || '#' || i || '/' || $3::int
			  AND c.lease_until >= clock_timestamp() AND (c.holder_pid IS NULL OR EXISTS (
				SELECT 1 FROM pg_stat_activity a WHERE a.pid = c.holder_pid AND a.backend_start = c.holder_backend_start))), '') AS owner
		FROM generate_series(0, $3::int - 1) i)`
}

// UnownedShards counts the shards of n for group that no relay holds a
// live lease of.
func (t Tables) UnownedShards(ctx context.Context, db DBTX, group string, n int) (int, error) {
	var unowned int
	if err := db.QueryRowContext(ctx, `WITH `+t.shardOwners()+` SELECT count(*) FROM s WHERE owner = ''`,
		t.OutboxTopic, group, n).Scan(&unowned); err != nil {
		return 0, fmt.Errorf("count unowned shards: %w", err)
	}
	return unowned, nil
}

// ShardStatus is one shard's owner and backlog.
type ShardStatus struct {
	// Shard is the shard's number.
	Shard int
	// Owner is the instance id of the relay holding the shard's lease; ""
	// when none does.
	Owner string
	// Pending counts the shard's committed rows not forwarded yet.
	Pending int64
	// OldestPendingAge is the age of the shard's oldest pending row.
	OldestPendingAge time.Duration
}

// ShardStatuses reports every shard of n for group: its owner and backlog.
func (t Tables) ShardStatuses(ctx context.Context, db DBTX, group string, n int) ([]ShardStatus, error) {
	rows, err := db.QueryContext(ctx, `WITH `+t.shardOwners()+` SELECT shard, owner FROM s`, t.OutboxTopic, group, n)
	owners, err := collectMap[int, string](rows, err, "read the shard owners")
	if err != nil {
		return nil, err
	}
	out := make([]ShardStatus, n)
	for i := range out {
		c := Cursor{Group: group, Shard: i, Shards: n}
		pending, oldest, err := t.Backlog(ctx, db, c)
		if err != nil {
			return nil, err
		}
		out[i] = ShardStatus{Shard: i, Owner: owners[i], Pending: pending, OldestPendingAge: oldest}
	}
	return out, nil
}

// ShardedStatus is Status for a group whose outbox is split into n > 1
// shards: a row is forwarded when its shard's cursor has forwarded it (a
// row whose shard is n or more was written under a larger count and
// forwarded before the change).
func (t Tables) ShardedStatus(ctx context.Context, db DBTX, group string, n int) (OutboxStatus, error) {
	var st OutboxStatus
	var age sql.NullFloat64
	var last sql.NullTime
	err := db.QueryRowContext(ctx, `
		WITH m AS (
			SELECT m.created_at,
				m.shard >= $3::int OR coalesce(`+forwarded+`, false) AS done,
				coalesce(m."offset" = c.read_offset, false) AS last
			FROM `+t.OutboxTable()+` m
			LEFT JOIN `+t.CursorsTable()+` c ON c.outbox_topic = $1 AND c.consumer_group = $2 || '#' || m.shard || '/' || $3::int)
		SELECT count(*) FILTER (WHERE NOT done),
			EXTRACT(EPOCH FROM LOCALTIMESTAMP - min(created_at) FILTER (WHERE NOT done))::float8,
			count(*) FILTER (WHERE done),
			(max(created_at) FILTER (WHERE last AND done)) AT TIME ZONE current_setting('TimeZone'),
			(SELECT count(*) FROM `+t.QuarantineTable()+`)
		FROM m`, t.OutboxTopic, group, n).Scan(&st.Pending, &age, &st.Forwarded, &last, &st.Quarantined)
	if err != nil {
		return OutboxStatus{}, fmt.Errorf("inspect outbox %s: %w", t.OutboxTable(), err)
	}
	st.OldestPendingAge = time.Duration(age.Float64 * float64(time.Second))
	st.LastForwardedAt = last.Time
	return st, nil
}
