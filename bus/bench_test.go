package bus_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// BenchmarkPublish publishes 1 and 100 events per transaction, typed and
// raw, on pgx and on database/sql, every variant once per iteration in
// turn (so that the machine's load weighs on each alike), and reports each
// variant's median time per transaction and the ratios the design promises:
// typed over raw (raw includes the caller's json.Marshal, which typed does
// for it), and 100 single-row Publish calls on database/sql over one call
// of 100 events on pgx.
func BenchmarkPublish(b *testing.B) {
	tb := setupBench(b)
	variants := tb.publishVariants()
	spent := make([][]time.Duration, len(variants))
	round := 0
	for b.Loop() {
		for k := range variants {
			i := (k + round) % len(variants) // each variant in every position in turn
			start := time.Now()
			variants[i].run(b)
			spent[i] = append(spent[i], time.Since(start))
		}
		round++
		if round%20 == 0 {
			_, err := tb.db.Exec(`TRUNCATE "` + tb.schema + `".watermill_millrace_outbox`)
			require.NoError(b, err)
		}
	}
	reportPublish(b, variants, spent)
}

// publishVariant is one way of publishing in a transaction.
type publishVariant struct {
	name string
	run  func(*testing.B)
}

// publishVariants are BenchmarkPublish's variants: 1 and 100 events, raw
// and typed, on database/sql and pgx, and 100 single-row calls on
// database/sql.
func (tb benchBundle) publishVariants() []publishVariant {
	ctx := context.Background()
	topic := bus.Must(bus.NewTopic[placedV2]("orders.events", bus.Version(2)))
	one, hundred := benchValues(1), benchValues(100)
	return []publishVariant{
		{"sql-raw-1", tb.sqlTx(func(b *testing.B, t txs) error {
			return tb.bus.Publish(ctx, t.sql, "orders.events", rawEvents(b, one)...)
		})},
		{"sql-typed-1", tb.sqlTx(func(b *testing.B, t txs) error { return topic.Publish(ctx, tb.bus, t.sql, one...) })},
		{"sql-raw-100", tb.sqlTx(func(b *testing.B, t txs) error {
			return tb.bus.Publish(ctx, t.sql, "orders.events", rawEvents(b, hundred)...)
		})},
		{"sql-typed-100", tb.sqlTx(func(b *testing.B, t txs) error { return topic.Publish(ctx, tb.bus, t.sql, hundred...) })},
		{"sql-100-single-row-calls", tb.sqlTx(func(b *testing.B, t txs) error {
			for _, v := range hundred {
				if err := topic.Publish(ctx, tb.bus, t.sql, v); err != nil {
					return err
				}
			}
			return nil
		})},
		{"pgx-raw-1", tb.pgxTx(func(b *testing.B, t txs) error {
			return tb.pgx.Publish(ctx, bus.Pgx(t.pgx), "orders.events", rawEvents(b, one)...)
		})},
		{"pgx-typed-1", tb.pgxTx(func(b *testing.B, t txs) error { return topic.Publish(ctx, tb.pgx, bus.Pgx(t.pgx), one...) })},
		{"pgx-raw-100", tb.pgxTx(func(b *testing.B, t txs) error {
			return tb.pgx.Publish(ctx, bus.Pgx(t.pgx), "orders.events", rawEvents(b, hundred)...)
		})},
		{"pgx-typed-100", tb.pgxTx(func(b *testing.B, t txs) error { return topic.Publish(ctx, tb.pgx, bus.Pgx(t.pgx), hundred...) })},
	}
}

// benchValues is n orders.
func benchValues(n int) []placedV2 {
	vs := make([]placedV2, n)
	for i := range vs {
		vs[i] = placedV2{OrderID: fmt.Sprintf("ord-%d", i), TotalCents: int64(i)}
	}
	return vs
}

// rawEvents is vs as raw events, marshalled by the caller.
func rawEvents(b *testing.B, vs []placedV2) []bus.Event {
	evs := make([]bus.Event, len(vs))
	for i, v := range vs {
		payload, err := json.Marshal(v)
		require.NoError(b, err)
		evs[i] = bus.Event{Type: "OrderPlaced", SchemaVersion: 2, AggregateType: "order", AggregateID: v.OrderID, Payload: payload}
	}
	return evs
}

// sqlTx runs publish in a database/sql transaction and commits it.
func (tb benchBundle) sqlTx(publish func(*testing.B, txs) error) func(*testing.B) {
	return func(b *testing.B) {
		tx, err := tb.db.BeginTx(context.Background(), nil)
		require.NoError(b, err)
		require.NoError(b, publish(b, txs{sql: tx}))
		require.NoError(b, tx.Commit())
	}
}

// pgxTx runs publish in a pgx transaction and commits it.
func (tb benchBundle) pgxTx(publish func(*testing.B, txs) error) func(*testing.B) {
	return func(b *testing.B) {
		ctx := context.Background()
		tx, err := tb.pool.Begin(ctx)
		require.NoError(b, err)
		require.NoError(b, publish(b, txs{pgx: tx}))
		require.NoError(b, tx.Commit(ctx))
	}
}

// reportPublish reports each variant's median time per transaction and
// the ratios the design promises.
func reportPublish(b *testing.B, variants []publishVariant, spent [][]time.Duration) {
	per := map[string]float64{}
	for i, v := range variants {
		// The median: a shared machine's stalls land on a few iterations.
		slices.Sort(spent[i])
		per[v.name] = float64(spent[i][len(spent[i])/2].Microseconds())
		b.ReportMetric(per[v.name], "µs/tx-"+v.name)
	}
	b.ReportMetric(per["sql-typed-1"]/per["sql-raw-1"], "x-typed/raw-sql-1")
	b.ReportMetric(per["sql-typed-100"]/per["sql-raw-100"], "x-typed/raw-sql-100")
	b.ReportMetric(per["pgx-typed-1"]/per["pgx-raw-1"], "x-typed/raw-pgx-1")
	b.ReportMetric(per["pgx-typed-100"]/per["pgx-raw-100"], "x-typed/raw-pgx-100")
	b.ReportMetric(per["sql-typed-1"]/per["pgx-typed-1"], "x-sql/pgx-1")
	b.ReportMetric(per["sql-typed-100"]/per["pgx-typed-100"], "x-sql/pgx-100")
	b.ReportMetric(per["sql-100-single-row-calls"]/per["pgx-typed-100"], "x-100-single-sql/100-pgx")
}

// txs is the transaction of one benchmark variant.
type txs struct {
	sql *sql.Tx
	pgx pgx.Tx
}

// benchBundle is a migrated schema with a Bus on database/sql and one on
// pgxpool.
type benchBundle struct {
	db     *sql.DB
	schema string
	bus    *bus.Bus
	pool   *pgxpool.Pool
	pgx    *bus.Bus
}

func setupBench(b *testing.B) benchBundle {
	ctx := context.Background()
	db := testdb.Open(b)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(b, db)
	cfg.Broker.NATS.URL = "nats://127.0.0.1:4222"
	require.NoError(b, bus.Migrate(ctx, db, cfg))
	sqlBus, err := bus.Open(ctx, cfg, db)
	require.NoError(b, err)
	b.Cleanup(func() { sqlBus.Close() })
	pool := testdb.Pool(b)
	pgxBus, err := bus.Open(ctx, cfg, pool)
	require.NoError(b, err)
	b.Cleanup(func() { pgxBus.Close() })
	return benchBundle{db: db, schema: cfg.Database.Schema, bus: sqlBus, pool: pool, pgx: pgxBus}
}
