package store_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testdb"
)

// outboxRows are n rows with fixed ids, payloads and metadata.
func outboxRows(prefix string, n int) []*message.Message {
	rows := make([]*message.Message, n)
	for i := range rows {
		rows[i] = message.NewMessage(fmt.Sprintf("%s-%04d", prefix, i), []byte(fmt.Sprintf(`{"destination_topic":"orders","payload":"eyJuIjo%d","metadata":{"a":"\u00e9 \"q\""}}`, i)))
		rows[i].Metadata = message.Metadata{"k": fmt.Sprint(i), "unicode": "ü\n\t"}
	}
	return rows
}

func openPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), testdb.URL())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// What WriteOutboxPgx stores is byte for byte what WriteOutbox stores, for
// more rows than one INSERT holds.
func TestWriteOutboxPgxStoresWhatWriteOutboxStores(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Open(t)
	pool := openPool(t)
	tables := store.Tables{Schema: testdb.Schema(t, db), OutboxTopic: "millrace_outbox"}
	require.NoError(t, store.Migrate(ctx, db, tables))

	sqlTx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tables.WriteOutbox(ctx, sqlTx, outboxRows("sql", 1001)))
	require.NoError(t, sqlTx.Commit())
	pgxTx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, tables.WriteOutboxPgx(ctx, pgxTx, outboxRows("pgx", 1001)))
	require.NoError(t, pgxTx.Commit(ctx))

	stored := func(prefix string) [][3]string {
		rows, err := db.QueryContext(ctx, `SELECT substr(uuid, 5), payload::text, metadata::text FROM `+tables.OutboxTable()+
			` WHERE uuid LIKE $1 ORDER BY "offset"`, prefix+"-%")
		require.NoError(t, err)
		defer rows.Close()
		var out [][3]string
		for rows.Next() {
			var r [3]string
			require.NoError(t, rows.Scan(&r[0], &r[1], &r[2]))
			out = append(out, r)
		}
		require.NoError(t, rows.Err())
		return out
	}
	viaSQL, viaPgx := stored("sql"), stored("pgx")
	require.Len(t, viaSQL, 1001)
	require.Equal(t, viaSQL, viaPgx)
}

// BenchmarkOutboxPgxInsert compares the two ways to write 100 outbox rows
// in one round trip on a pgx transaction: one multi-row INSERT (what
// WriteOutboxPgx does) and a pgx.Batch of single-row INSERTs.
func BenchmarkOutboxPgxInsert(b *testing.B) {
	ctx := context.Background()
	db := testdb.Open(b)
	pool := openPool(b)
	tables := store.Tables{Schema: testdb.Schema(b, db), OutboxTopic: "millrace_outbox"}
	require.NoError(b, store.Migrate(ctx, db, tables))
	rows := outboxRows("bench", 100)
	schema := tables.SchemaAdapter()

	inTx := func(b *testing.B, write func(pgx.Tx) error) {
		for b.Loop() {
			tx, err := pool.Begin(ctx)
			require.NoError(b, err)
			require.NoError(b, write(tx))
			require.NoError(b, tx.Commit(ctx))
		}
	}
	b.Run("multi-row-insert", func(b *testing.B) {
		inTx(b, func(tx pgx.Tx) error { return tables.WriteOutboxPgx(ctx, tx, rows) })
	})
	b.Run("batch-of-single-row-inserts", func(b *testing.B) {
		inTx(b, func(tx pgx.Tx) error {
			batch := &pgx.Batch{}
			for _, r := range rows {
				q, err := schema.InsertQuery(tables.OutboxTopic, message.Messages{r})
				if err != nil {
					return err
				}
				batch.Queue(q.Query, q.Args...)
			}
			return tx.SendBatch(ctx, batch).Close()
		})
	})
}
