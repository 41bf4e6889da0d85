package store_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// migrated is a migrated schema of a test's own, with the default outbox
// topic.
func migrated(t *testing.T) (*sql.DB, store.Tables) {
	t.Helper()
	db := testdb.Open(t)
	tables := store.Tables{Schema: testdb.Schema(t, db), OutboxTopic: "millrace_outbox"}
	require.NoError(t, store.Migrate(context.Background(), db, tables))
	return db, tables
}

// writeEvents commits one outbox row per aggregate id, each a forwarder
// envelope whose message carries that aggregate-id (none for "-").
func writeEvents(t *testing.T, db *sql.DB, tables store.Tables, aggregates ...string) {
	t.Helper()
	rows := make([]*message.Message, len(aggregates))
	for i, agg := range aggregates {
		msg := message.NewMessage(fmt.Sprintf("m-%d", i), []byte(`{}`))
		if agg != "-" {
			msg.Metadata.Set(envelope.AggregateIDKey, agg)
		}
		payload, err := envelope.Wrap("orders", msg)
		require.NoError(t, err)
		rows[i] = message.NewMessage(msg.UUID, payload)
	}
	tx, err := db.Begin()
	require.NoError(t, err)
	require.NoError(t, tables.WriteOutbox(context.Background(), tx, rows))
	require.NoError(t, tx.Commit())
}

// shardOf returns the shard column of every row, by the aggregate-id in its
// envelope ("" when it has none).
func shardOf(t *testing.T, db *sql.DB, tables store.Tables) map[string][]int {
	t.Helper()
	rows, err := db.Query(`SELECT coalesce(payload::json -> 'metadata' ->> 'aggregate-id', ''), shard FROM ` + tables.OutboxTable())
	require.NoError(t, err)
	defer rows.Close()
	out := map[string][]int{}
	for rows.Next() {
		var agg string
		var shard int
		require.NoError(t, rows.Scan(&agg, &shard))
		out[agg] = append(out[agg], shard)
	}
	require.NoError(t, rows.Err())
	return out
}

// ackAll forwards every committed row of each cursor's shard, as a relay
// does.
func ackAll(t *testing.T, db *sql.DB, tables store.Tables, cursors ...store.Cursor) {
	t.Helper()
	for _, c := range cursors {
		forward(t, db, tables, c, -1)
	}
}

func cursors(group string, n int) []store.Cursor {
	cs := make([]store.Cursor, n)
	for i := range cs {
		cs[i] = store.Cursor{Group: group, Shard: i, Shards: n}
	}
	return cs
}

// With one shard every row is in shard 0. With eight, PostgreSQL's hash of
// the aggregate id picks the shard: one aggregate always lands in the same
// shard, 200 aggregates use all eight, and a row without an aggregate id, or
// whose payload is not an envelope, goes to shard 0.
func TestTheTriggerShardsRowsByAggregate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)
	writeEvents(t, db, tables, "a", "b", "c")
	for agg, shards := range shardOf(t, db, tables) {
		require.Equal(t, []int{0}, shards, agg)
	}
	ackAll(t, db, tables, store.Cursor{Group: "g"})
	require.NoError(t, tables.RecordShards(ctx, db, "g", 8))
	n, err := tables.RecordedShards(ctx, db)
	require.NoError(t, err)
	require.Equal(t, 8, n)

	var aggs []string
	for i := range 200 {
		aggs = append(aggs, fmt.Sprintf("agg-%d", i), fmt.Sprintf("agg-%d", i))
	}
	writeEvents(t, db, tables, append(aggs, "-", "")...)
	_, err = db.Exec(`INSERT INTO ` + tables.OutboxTable() + ` (uuid, payload, metadata, transaction_id) VALUES
		('scalar', '"text"', '{}', pg_current_xact_id()), ('array', '[1]', '{}', pg_current_xact_id()),
		('nometa', '{"destination_topic":"t","metadata":5}', '{}', pg_current_xact_id())`)
	require.NoError(t, err)

	got := shardOf(t, db, tables)
	used := map[int]bool{}
	for i := range 200 {
		agg := fmt.Sprintf("agg-%d", i)
		s := got[agg]
		require.Len(t, s, 2, agg)
		require.Equal(t, s[0], s[1], "%s: one aggregate, one shard", agg)
		require.GreaterOrEqual(t, s[0], 0)
		require.Less(t, s[0], 8)
		var want int
		require.NoError(t, db.QueryRow(`SELECT ((hashtextextended($1, 0) % 8) + 8) % 8`, agg).Scan(&want))
		require.Equal(t, want, s[0], agg)
		used[s[0]] = true
	}
	require.Len(t, used, 8, "200 aggregates spread over all 8 shards")
	require.Equal(t, []int{0, 0, 0, 0, 0}, got[""], "no aggregate id, or no envelope: shard 0")
}

// A change of the shard count is refused while the group has rows pending
// under the recorded count, naming both counts; once they are forwarded it
// is recorded, and the new shards start where the old ones ended, so nothing
// forwarded is sent again and nothing written after is skipped.
func TestShardCountChangesOnlyWhenNothingIsPending(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)
	const group = "relay_a"
	require.NoError(t, tables.RecordShards(ctx, db, group, 8), "an empty outbox takes any count")
	for _, c := range cursors(group, 8) {
		n, _, err := tables.Backlog(ctx, db, c)
		require.NoError(t, err)
		require.Zero(t, n)
	}
	writeEvents(t, db, tables, "a", "b", "c", "d", "e", "f")

	err := tables.RecordShards(ctx, db, group, 4)
	var change *store.ShardsChangeError
	require.ErrorAs(t, err, &change)
	require.ErrorIs(t, err, store.ErrShardsChanged)
	require.Equal(t, store.ShardsChangeError{Recorded: 8, Wanted: 4, Pending: 6}, *change)
	n, err := tables.RecordedShards(ctx, db)
	require.NoError(t, err)
	require.Equal(t, 8, n, "a refused change records nothing")
	require.ErrorIs(t, tables.RecordShards(ctx, db, group, 1), store.ErrShardsChanged)

	ackAll(t, db, tables, cursors(group, 8)...)
	require.NoError(t, tables.RecordShards(ctx, db, group, 4))
	for _, c := range cursors(group, 4) {
		n, _, err := tables.Backlog(ctx, db, c)
		require.NoError(t, err)
		require.Zero(t, n, "%s starts past every forwarded row", c.Row())
	}
	writeEvents(t, db, tables, "a", "b", "c", "d", "e", "f", "g", "h")
	total := int64(0)
	for _, c := range cursors(group, 4) {
		n, _, err := tables.Backlog(ctx, db, c)
		require.NoError(t, err)
		total += n
	}
	require.Equal(t, int64(8), total, "rows written after the change are pending in the new shards")
	for agg, shards := range shardOf(t, db, tables) {
		require.Less(t, shards[len(shards)-1], 4, agg)
	}

	ackAll(t, db, tables, cursors(group, 4)...)
	require.NoError(t, tables.RecordShards(ctx, db, group, 1), "back to one shard")
	left, _, err := tables.Backlog(ctx, db, store.Cursor{Group: group})
	require.NoError(t, err)
	require.Zero(t, left)
	require.ErrorContains(t, tables.RecordShards(ctx, db, group, 0), "must be from 1 to 256")
}

// A sharded outbox notifies once per shard a transaction wrote to, naming
// the shard, and never the whole outbox, so that a notification wakes only
// the relay of its shard; an unsharded one names the outbox.
func TestCommitNotifiesTheShardsItWrote(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tables := migrated(t)
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(ctx, `LISTEN `+store.NotifyChannel)
	require.NoError(t, err)
	// next returns the next notification of this outbox (the channel is
	// shared with other tests' outboxes), as NotifiedShard reads it.
	next := func() (int, string) {
		var shard int
		var payload string
		require.NoError(t, conn.Raw(func(dc any) error {
			waitCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			for {
				n, err := dc.(*stdlib.Conn).Conn().WaitForNotification(waitCtx)
				if err != nil {
					return err
				}
				if s, ours := tables.NotifiedShard(n.Payload); ours {
					shard, payload = s, n.Payload
					return nil
				}
			}
		}))
		return shard, payload
	}

	writeEvents(t, db, tables, "a", "b")
	shard, payload := next()
	require.Equal(t, -1, shard, "one shard: the notification names the outbox: %s", payload)
	require.Equal(t, tables.OutboxNotifyPayload(), payload)
	ackAll(t, db, tables, store.Cursor{Group: "g"})
	require.NoError(t, tables.RecordShards(ctx, db, "g", 8))

	var aggs []string
	for i := range 40 {
		aggs = append(aggs, fmt.Sprintf("agg-%d", i))
	}
	writeEvents(t, db, tables, aggs...)
	written := shardOf(t, db, tables)
	want := map[int]bool{}
	for _, agg := range aggs {
		want[written[agg][0]] = true
	}
	require.Greater(t, len(want), 4, "40 aggregates use most of the eight shards")
	got := map[int]bool{}
	for len(got) < len(want) {
		shard, payload := next()
		require.GreaterOrEqual(t, shard, 0, "eight shards: every notification names a shard: %s", payload)
		require.True(t, want[shard], "shard %d was not written to", shard)
		require.False(t, got[shard], "shard %d notified twice in one transaction", shard)
		got[shard] = true
	}
	// The next transaction's notification comes next: no notification of
	// the whole outbox followed those of the shards.
	writeEvents(t, db, tables, "agg-0")
	shard, payload = next()
	require.Equal(t, written["agg-0"][0], shard, payload)
}

func TestNotifiedShardReadsThePayload(t *testing.T) {
	t.Parallel()
	tables := store.Tables{Schema: "s", OutboxTopic: "millrace_outbox"}
	for payload, want := range map[string]struct {
		shard int
		ours  bool
	}{
		"s.watermill_millrace_outbox":     {-1, true},
		"s.watermill_millrace_outbox/0":   {0, true},
		"s.watermill_millrace_outbox/17":  {17, true},
		"s.watermill_millrace_outbox/x":   {-1, true},
		"s.watermill_millrace_outbox2":    {0, false},
		"s.watermill_millrace_outbox2/3":  {0, false},
		"other.watermill_millrace_outbox": {0, false},
	} {
		shard, ours := tables.NotifiedShard(payload)
		require.Equal(t, want.ours, ours, payload)
		if ours {
			require.Equal(t, want.shard, shard, payload)
		}
	}
}
