package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// MaxShards bounds relay.shards: the shard column is a smallint, and every
// shard costs an offsets row, an advisory lock and a fallback poll.
const MaxShards = 256

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

// Row is the consumer_group of c's offsets row: the group itself for the
// whole outbox, "<group>#<shard>/<shards>" for a shard.
func (c Cursor) Row() string {
	if c.Shards <= 1 {
		return c.Group
	}
	return c.Group + "#" + strconv.Itoa(c.Shard) + "/" + strconv.Itoa(c.Shards)
}

// filter is the SQL condition that keeps c's shard, after prefix ("AND ",
// "WHERE ", "AND m."), or "" for the whole outbox.
func (c Cursor) filter(prefix string) string {
	if c.Shards <= 1 {
		return ""
	}
	return prefix + "shard = " + strconv.Itoa(c.Shard)
}

// ShardsTable is the qualified table recording, per outbox, the shard count
// its shard column is written with.
func (t Tables) ShardsTable() string { return t.qualify("millrace_relay_shards") }

// InstancesTable is the qualified registry of running sharded relays: one
// row per instance, with its lock session and heartbeat.
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
		`CREATE INDEX IF NOT EXISTS watermill_` + t.OutboxTopic + `_shard ON ` + outbox + ` (shard, transaction_id, "offset")`,
		`CREATE TABLE IF NOT EXISTS ` + t.ShardsTable() + ` (
	outbox_topic TEXT PRIMARY KEY,
	shards INTEGER NOT NULL CHECK (shards BETWEEN 1 AND ` + strconv.Itoa(MaxShards) + `),
	recorded_at TIMESTAMPTZ NOT NULL DEFAULT now()
)`,
		`CREATE TABLE IF NOT EXISTS ` + t.InstancesTable() + ` (
	consumer_group TEXT NOT NULL,
	instance_id TEXT NOT NULL,
	pid INTEGER NOT NULL,
	backend_start TIMESTAMPTZ NOT NULL,
	started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	heartbeat_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	PRIMARY KEY (consumer_group, instance_id)
)`,
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
		`DO $$ BEGIN
	IF NOT EXISTS (SELECT 1 FROM pg_trigger
		WHERE tgname = 'millrace_shard' AND tgrelid = '` + outbox + `'::regclass) THEN
		CREATE TRIGGER millrace_shard BEFORE INSERT ON ` + outbox + `
			FOR EACH ROW EXECUTE FUNCTION ` + t.shardFunction() + `();
	END IF;
END $$`,
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
	var n int
	err := db.QueryRowContext(ctx, `SELECT shards FROM `+t.ShardsTable()+` WHERE outbox_topic = $1`, t.OutboxTopic).Scan(&n)
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, sql.ErrNoRows), errors.As(err, &pgErr) && pgErr.Code == "42P01": // undefined_table
		return 1, nil
	case err != nil:
		return 0, fmt.Errorf("read the shard count of %s: %w", t.OutboxTable(), err)
	}
	return n, nil
}

// RecordShards makes n the outbox's shard count for group, if it is not
// already. A change is refused with a *ShardsChangeError while group has
// rows pending under the recorded count. Otherwise, with the outbox locked
// against writers (a writer in flight commits first; the next waits), it
// records n, so the trigger shards every row inserted after it by n, and
// starts each new offsets row of group at the furthest position of the old
// ones: every row before it was forwarded, and no transaction can still
// add one before it (each acked position was below the xid8 horizon).
// Rows already written keep their shard value; nothing is rewritten.
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
	old := make([]Cursor, recorded)
	pending := int64(0)
	for i := range old {
		old[i] = Cursor{Group: group, Shard: i, Shards: recorded}
		p, _, err := t.Backlog(ctx, tx, old[i])
		if err != nil {
			return err
		}
		pending += p
	}
	if pending > 0 {
		return &ShardsChangeError{Recorded: recorded, Wanted: n, Pending: pending}
	}
	rows := make([]string, recorded)
	for i, c := range old {
		rows[i] = c.Row()
	}
	// The furthest old position, or zero when group never acked a row.
	if _, err := tx.ExecContext(ctx, `
		WITH p AS (
			SELECT coalesce(max(last_processed_transaction_id), '0'::xid8) AS txid FROM `+t.OffsetsTable()+` WHERE consumer_group = ANY($1)),
		q AS (
			SELECT p.txid, coalesce((SELECT max(offset_acked) FROM `+t.OffsetsTable()+`
				WHERE consumer_group = ANY($1) AND last_processed_transaction_id = p.txid), 0) AS offset_acked FROM p)
		INSERT INTO `+t.OffsetsTable()+` (consumer_group, offset_acked, last_processed_transaction_id)
		SELECT r, q.offset_acked, q.txid FROM q, unnest($2::text[]) r
		ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = excluded.offset_acked,
			last_processed_transaction_id = excluded.last_processed_transaction_id`,
		rows, newRows(group, n)); err != nil {
		return fmt.Errorf("start the offsets rows of %d shards: %w", n, err)
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

func newRows(group string, n int) []string {
	rows := make([]string, n)
	for i := range rows {
		rows[i] = Cursor{Group: group, Shard: i, Shards: n}.Row()
	}
	return rows
}

// ShardLockName is the name whose hash keys the session advisory lock that
// owns shard i of n for group.
func (t Tables) ShardLockName(group string, i, n int) string {
	return fmt.Sprintf("millrace relay %s %s shard %d/%d", t.OutboxNotifyPayload(), group, i, n)
}

// TryLockShard takes the advisory lock of shard i of n on conn's session,
// without waiting, and says whether it got it.
func (t Tables) TryLockShard(ctx context.Context, conn DBTX, group string, i, n int) (bool, error) {
	var ok bool
	err := conn.QueryRowContext(ctx, `SELECT pg_try_advisory_lock(hashtextextended($1, 0))`, t.ShardLockName(group, i, n)).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("take the lock of shard %d/%d: %w", i, n, err)
	}
	return ok, nil
}

// UnlockShard releases the advisory lock of shard i of n held by conn's session.
func (t Tables) UnlockShard(ctx context.Context, conn DBTX, group string, i, n int) error {
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_unlock(hashtextextended($1, 0))`, t.ShardLockName(group, i, n)); err != nil {
		return fmt.Errorf("release the lock of shard %d/%d: %w", i, n, err)
	}
	return nil
}

// Heartbeat registers instance id of group on conn's session (the one
// holding its shard locks), or renews its heartbeat.
func (t Tables) Heartbeat(ctx context.Context, conn DBTX, group, id string) error {
	_, err := conn.ExecContext(ctx, `INSERT INTO `+t.InstancesTable()+` (consumer_group, instance_id, pid, backend_start)
		SELECT $1, $2, pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()
		ON CONFLICT (consumer_group, instance_id) DO UPDATE
		SET pid = excluded.pid, backend_start = excluded.backend_start, heartbeat_at = now()`, group, id)
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

// LiveInstances deletes the registry rows of group whose session is gone
// or whose heartbeat is older than ttl, and counts the others. A killed
// relay's row goes as soon as PostgreSQL closes its session.
func (t Tables) LiveInstances(ctx context.Context, db DBTX, group string, ttl time.Duration) (int, error) {
	var n int
	err := db.QueryRowContext(ctx, `
		WITH gone AS (
			DELETE FROM `+t.InstancesTable()+` i WHERE i.consumer_group = $1
			AND (i.heartbeat_at < now() - make_interval(secs => $2) OR NOT EXISTS (
				SELECT 1 FROM pg_stat_activity a WHERE a.pid = i.pid AND a.backend_start = i.backend_start))
			RETURNING instance_id)
		SELECT count(*) FROM `+t.InstancesTable()+` WHERE consumer_group = $1
			AND instance_id NOT IN (SELECT instance_id FROM gone)`, group, ttl.Seconds()).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count live relays: %w", err)
	}
	return n, nil
}

// shardLocks is a CTE "s" of the n shards of group with their lock's
// owning backend pid (NULL when no session holds it); $1 is group, $2 n.
func (t Tables) shardLocks() string {
	return `s AS (
		SELECT i AS shard, (SELECT l.pid FROM pg_locks l
			WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
			  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND l.classid::bigint = (k >> 32) & 4294967295 AND l.objid::bigint = k & 4294967295) AS pid
		FROM (SELECT i, hashtextextended(format('millrace relay %s %s shard %s/%s', '` + t.OutboxNotifyPayload() + `', $1::text, i, $2::int), 0) AS k
			FROM generate_series(0, $2::int - 1) i) keys)`
}

// UnownedShards counts the shards of n for group whose lock no session holds.
func (t Tables) UnownedShards(ctx context.Context, db DBTX, group string, n int) (int, error) {
	var unowned int
	if err := db.QueryRowContext(ctx, `WITH `+t.shardLocks()+` SELECT count(*) FROM s WHERE pid IS NULL`, group, n).Scan(&unowned); err != nil {
		return 0, fmt.Errorf("count unowned shards: %w", err)
	}
	return unowned, nil
}

// ShardStatus is one shard's owner and backlog.
type ShardStatus struct {
	// Shard is the shard's number.
	Shard int
	// Owner is the instance id of the relay holding the shard's lock; ""
	// when none does.
	Owner string
	// Pending counts the shard's committed rows not forwarded yet.
	Pending int64
	// OldestPendingAge is the age of the shard's oldest pending row.
	OldestPendingAge time.Duration
}

// ShardStatuses reports every shard of n for group: its owner and backlog.
func (t Tables) ShardStatuses(ctx context.Context, db DBTX, group string, n int) ([]ShardStatus, error) {
	owners := map[int]string{}
	rows, err := db.QueryContext(ctx, `WITH `+t.shardLocks()+`
		SELECT s.shard, coalesce((SELECT r.instance_id FROM `+t.InstancesTable()+` r
			WHERE r.consumer_group = $1 AND r.pid = s.pid LIMIT 1), 'pid ' || s.pid::text)
		FROM s WHERE s.pid IS NOT NULL`, group, n)
	if err != nil {
		return nil, fmt.Errorf("read the shard owners: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var i int
		var owner string
		if err := rows.Scan(&i, &owner); err != nil {
			return nil, fmt.Errorf("read the shard owners: %w", err)
		}
		owners[i] = owner
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the shard owners: %w", err)
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
// shards: a row is forwarded when its shard's offsets row is at or past it
// (a row whose shard is n or more was written under a larger count and
// forwarded before the change).
func (t Tables) ShardedStatus(ctx context.Context, db DBTX, group string, n int) (OutboxStatus, error) {
	var st OutboxStatus
	var age sql.NullFloat64
	var last sql.NullTime
	err := db.QueryRowContext(ctx, `
		WITH o AS (
			SELECT i AS shard, r.offset_acked, r.last_processed_transaction_id AS txid
			FROM generate_series(0, $2::int - 1) i
			JOIN `+t.OffsetsTable()+` r ON r.consumer_group = $1 || '#' || i || '/' || $2),
		m AS (
			SELECT created_at,
				m.shard >= $2 OR EXISTS (SELECT 1 FROM o WHERE o.shard = m.shard
					AND (m.transaction_id < o.txid OR (m.transaction_id = o.txid AND m."offset" <= o.offset_acked))) AS done,
				EXISTS (SELECT 1 FROM o WHERE o.shard = m.shard AND m.transaction_id = o.txid AND m."offset" = o.offset_acked) AS last
			FROM `+t.OutboxTable()+` m)
		SELECT count(*) FILTER (WHERE NOT done),
			EXTRACT(EPOCH FROM LOCALTIMESTAMP - min(created_at) FILTER (WHERE NOT done))::float8,
			count(*) FILTER (WHERE done),
			(max(created_at) FILTER (WHERE last)) AT TIME ZONE current_setting('TimeZone'),
			(SELECT count(*) FROM `+t.QuarantineTable()+`)
		FROM m`, group, n).Scan(&st.Pending, &age, &st.Forwarded, &last, &st.Quarantined)
	if err != nil {
		return OutboxStatus{}, fmt.Errorf("inspect outbox %s: %w", t.OutboxTable(), err)
	}
	st.OldestPendingAge = time.Duration(age.Float64 * float64(time.Second))
	st.LastForwardedAt = last.Time
	return st, nil
}
