package store_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/testdb"
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

// writeOutbox commits the n rows outboxRows makes of prefix in one
// transaction on db.
func writeOutbox(t testing.TB, db *sql.DB, tables store.Tables, prefix string, n int) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tables.WriteOutbox(ctx, tx, outboxRows(prefix, n)))
	require.NoError(t, tx.Commit())
}

// What WriteOutbox stores through Pgx is byte for byte what it stores on
// a *sql.Tx, for more rows than one INSERT holds.
func TestWriteOutboxOnPgxStoresWhatItStoresOnSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Open(t)
	pool := testdb.Pool(t)
	tables := store.Tables{Schema: testdb.Schema(t, db), OutboxTopic: "millrace_outbox"}
	require.NoError(t, store.Migrate(ctx, db, tables))

	writeOutbox(t, db, tables, "sql", 1001)
	pgxTx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, tables.WriteOutbox(ctx, store.Pgx(pgxTx), outboxRows("pgx", 1001)))
	require.NoError(t, pgxTx.Commit(ctx))

	// Each row's id (without its prefix), payload and metadata as text, in
	// one JSON array.
	stored := func(prefix string) []string {
		return testdb.Column[string](t, db, `SELECT json_build_array(substr(uuid, 5), payload::text, metadata::text)::text FROM `+
			tables.OutboxTable()+` WHERE uuid LIKE $1 ORDER BY "offset"`, prefix+"-%")
	}
	viaSQL, viaPgx := stored("sql"), stored("pgx")
	require.Len(t, viaSQL, 1001)
	require.Equal(t, viaSQL, viaPgx)
}

// BenchmarkOutboxPgxInsert compares ways to write 100 outbox rows in one
// transaction: on pgx, one multi-row INSERT (what WriteOutbox does through Pgx) and
// a pgx.Batch of single-row INSERTs, both one round trip; on database/sql,
// one multi-row INSERT (WriteOutbox) and 100 single-row INSERTs. Each
// variant runs once per iteration in turn; it reports their median times
// and ratios.
func BenchmarkOutboxPgxInsert(b *testing.B) {
	ctx := context.Background()
	db := testdb.Open(b)
	pool := testdb.Pool(b)
	tables := store.Tables{Schema: testdb.Schema(b, db), OutboxTopic: "millrace_outbox"}
	require.NoError(b, store.Migrate(ctx, db, tables))
	rows := outboxRows("bench", 100)
	schema := tables.SchemaAdapter()

	pgxTx := func(write func(pgx.Tx) error) func() {
		return func() {
			tx, err := pool.Begin(ctx)
			require.NoError(b, err)
			require.NoError(b, write(tx))
			require.NoError(b, tx.Commit(ctx))
		}
	}
	sqlTx := func(write func(*sql.Tx) error) func() {
		return func() {
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(b, err)
			require.NoError(b, write(tx))
			require.NoError(b, tx.Commit())
		}
	}
	variants := []struct {
		name string
		run  func()
	}{
		{"pgx-multi-row-insert", pgxTx(func(tx pgx.Tx) error { return tables.WriteOutbox(ctx, store.Pgx(tx), rows) })},
		{"pgx-batch-of-single-row-inserts", pgxTx(func(tx pgx.Tx) error {
			batch := &pgx.Batch{}
			for _, r := range rows {
				q, err := schema.InsertQuery(tables.OutboxTopic, message.Messages{r})
				if err != nil {
					return err
				}
				batch.Queue(q.Query, q.Args...)
			}
			return tx.SendBatch(ctx, batch).Close()
		})},
		{"sql-multi-row-insert", sqlTx(func(tx *sql.Tx) error { return tables.WriteOutbox(ctx, tx, rows) })},
		{"sql-100-single-row-inserts", sqlTx(func(tx *sql.Tx) error {
			for _, r := range rows {
				if err := tables.WriteOutbox(ctx, tx, []*message.Message{r}); err != nil {
					return err
				}
			}
			return nil
		})},
	}
	spent := make([][]time.Duration, len(variants))
	round := 0
	for b.Loop() {
		for k := range variants {
			i := (k + round) % len(variants)
			start := time.Now()
			variants[i].run()
			spent[i] = append(spent[i], time.Since(start))
		}
		round++
	}
	median := map[string]float64{}
	for i, v := range variants {
		slices.Sort(spent[i])
		median[v.name] = float64(spent[i][len(spent[i])/2].Microseconds())
		b.ReportMetric(median[v.name], "µs/tx-"+v.name)
	}
	b.ReportMetric(median["pgx-batch-of-single-row-inserts"]/median["pgx-multi-row-insert"], "x-pgx-batch/multi-row")
	b.ReportMetric(median["sql-100-single-row-inserts"]/median["pgx-multi-row-insert"], "x-sql-100-single/pgx-multi-row")
	b.ReportMetric(median["sql-multi-row-insert"]/median["pgx-multi-row-insert"], "x-sql/pgx-multi-row")
}
