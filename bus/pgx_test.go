package bus_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/lib/pq" // the "postgres" driver Open must refuse
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/ops"
)

// pgxBundle is a Bus opened on a *pgxpool.Pool on a migrated schema.
type pgxBundle struct {
	testBundle
	pool *pgxpool.Pool
	pgx  *bus.Bus
}

func setupPgx(t *testing.T, change ...func(*bus.Config)) pgxBundle {
	t.Helper()
	tb := setup(t, change...)
	pool := testdb.Pool(t)
	b, err := bus.Open(context.Background(), tb.cfg, pool)
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	return pgxBundle{testBundle: tb, pool: pool, pgx: b}
}

// beginPgx begins a transaction on the bundle's pool.
func (pb pgxBundle) beginPgx(t *testing.T) pgx.Tx {
	t.Helper()
	tx, err := pb.pool.Begin(context.Background())
	require.NoError(t, err)
	return tx
}

// The same events published on a pgx transaction and on a *sql.Tx are the
// same outbox rows, byte for byte; typed publishing on pgx writes what
// typed publishing on database/sql writes.
func TestPgxAndSQLWriteByteIdenticalRows(t *testing.T) {
	t.Parallel()
	pb := setupPgx(t)
	ctx := context.Background()
	occurred := time.Date(2026, 3, 4, 5, 6, 7, 8, time.UTC)
	events := func() []bus.Event {
		evs := make([]bus.Event, 3)
		for i := range evs {
			evs[i] = orderCreated("o-1")
			evs[i].ID = "evt-" + string(rune('a'+i))
			evs[i].AggregateVersion = int64(i + 1)
			evs[i].OccurredAt = occurred
			evs[i].Metadata = map[string]string{"tenant": "acme", "note": "ü \"quoted\"\n"}
		}
		return evs
	}
	placed := bus.Must(bus.NewTopic[placedV2]("orders.events", bus.Version(2)))
	value := placedV2{OrderID: "o-2", TotalCents: 99}

	sqlTx, err := pb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, pb.bus.Publish(ctx, sqlTx, "orders.events", events()...))
	require.NoError(t, sqlTx.Commit())
	pgxTx := pb.beginPgx(t)
	require.NoError(t, pb.pgx.Publish(ctx, bus.Pgx(pgxTx), "orders.events", events()...))
	require.NoError(t, pgxTx.Commit(ctx))

	stored := func() [][2]string {
		rows, err := pb.db.Query(`SELECT payload::text, metadata::text FROM "` + pb.schema + `".watermill_millrace_outbox ORDER BY "offset"`)
		require.NoError(t, err)
		defer rows.Close()
		var out [][2]string
		for rows.Next() {
			var r [2]string
			require.NoError(t, rows.Scan(&r[0], &r[1]))
			out = append(out, r)
		}
		return out
	}
	rows := stored()
	require.Len(t, rows, 6)
	require.Equal(t, rows[:3], rows[3:], "rows written via database/sql, then via pgx")

	// Typed: the event ids differ (new UUIDv7s), everything else is equal.
	sqlTx, err = pb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, placed.Publish(ctx, pb.bus, sqlTx, value))
	require.NoError(t, sqlTx.Commit())
	pgxTx = pb.beginPgx(t)
	require.NoError(t, placed.Publish(ctx, pb.pgx, bus.Pgx(pgxTx), value))
	require.NoError(t, pgxTx.Commit(ctx))
	out := pb.outbox(t)
	require.Len(t, out, 8)
	viaSQL, viaPgx := out[6].event, out[7].event
	require.NotEqual(t, viaSQL.ID, viaPgx.ID)
	viaPgx.ID, viaPgx.OccurredAt = viaSQL.ID, viaSQL.OccurredAt
	require.Equal(t, viaSQL, viaPgx)
}

// Publish on a pgx.Tx (through Pgx) in a rolled-back transaction leaves
// nothing; a refused event writes nothing and leaves the transaction
// usable; a nil or finished transaction is an error.
func TestPublishOnPgxRollbackAndRefusal(t *testing.T) {
	t.Parallel()
	pb := setupPgx(t)
	ctx := context.Background()
	tx := pb.beginPgx(t)
	require.NoError(t, pb.pgx.Publish(ctx, bus.Pgx(tx), "orders.events", orderCreated("o-1"), orderCreated("o-2")))
	require.NoError(t, tx.Rollback(ctx))
	require.Empty(t, pb.outbox(t))

	tx = pb.beginPgx(t)
	bad := orderCreated("o-3")
	bad.Payload = []byte(`{not json`)
	err := pb.pgx.Publish(ctx, bus.Pgx(tx), "orders.events", orderCreated("o-2"), bad)
	require.ErrorIs(t, err, bus.ErrInvalidPayload)
	var n int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM "`+pb.schema+`".watermill_millrace_outbox`).Scan(&n))
	require.Zero(t, n, "nothing of the refused call was written, and the transaction still answers")
	require.NoError(t, tx.Commit(ctx))

	require.ErrorIs(t, pb.pgx.Publish(ctx, bus.Pgx(nil), "orders.events", orderCreated("o-4")), bus.ErrNilTx)
	require.ErrorIs(t, pb.pgx.Publish(ctx, bus.Pgx(tx), "orders.events", orderCreated("o-4")), pgx.ErrTxClosed)
	require.Empty(t, pb.outbox(t))
}

// A handler of a Bus opened on a *pgxpool.Pool writes through its pgx.Tx: a
// duplicate delivery has one effect, a failing handler none, and
// bus.Tx[*sql.Tx] there names bus.Tx[pgx.Tx].
func TestPgxHandlerWritesInItsInboxTransactionOnce(t *testing.T) {
	t.Parallel()
	pb := setupPgx(t, func(c *bus.Config) { c.Consumer.Retry.MaxAttempts = 1 })
	ctx := context.Background()
	_, err := pb.db.Exec(`CREATE TABLE "` + pb.schema + `".invoices (order_id text PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)
	calls := 0
	handle, err := pb.pgx.ConsumerChain(ctx, "orders.events", "billing", func(ctx context.Context, ev bus.Event) error {
		calls++
		tx := bus.Tx[pgx.Tx](ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO "`+pb.schema+`".invoices VALUES ($1, $2)`, ev.AggregateID, ev.ID); err != nil {
			return err
		}
		if ev.AggregateID == "o-fail" {
			return bus.Permanent(sql.ErrNoRows) // after the write: it must roll back
		}
		if ev.AggregateID == "o-sqltx" {
			bus.Tx[*sql.Tx](ctx)
		}
		return nil
	}, nil)
	require.NoError(t, err)
	for range 2 {
		require.NoError(t, handle(delivered(ctx, "e-1", orderCreated("o-1"))))
	}
	require.NoError(t, handle(delivered(ctx, "e-2", orderCreated("o-fail"))))
	require.NoError(t, handle(delivered(ctx, "e-3", orderCreated("o-sqltx"))))
	require.Equal(t, 3, calls, "the duplicate was acked without calling the handler")

	var invoices []string
	rows, err := pb.db.Query(`SELECT order_id FROM "` + pb.schema + `".invoices`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		invoices = append(invoices, id)
	}
	require.Equal(t, []string{"o-1"}, invoices, "one effect of e-1; the failed handlers' writes rolled back")
	oc, err := ops.New(ctx, pb.db, pb.cfg)
	require.NoError(t, err)
	list, err := oc.DLQ().List(ctx, ops.Filter{Handler: "billing"}, 0)
	require.NoError(t, err)
	require.Len(t, list.Rows, 2)
	reasons := map[string]string{}
	for _, m := range list.Rows {
		reasons[m.EventID] = m.Reason
	}
	require.Contains(t, reasons["e-3"], "bus.Tx[*sql.Tx]: the Bus was opened on a *pgxpool.Pool, so the handler's transaction is a pgx.Tx: use bus.Tx[pgx.Tx](ctx)")
}

// Open refuses a *sql.DB of another driver at once, naming it and the fix.
func TestOpenRefusesAnotherDriver(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	defer db.Close()
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, testdb.Open(t))
	_, err = bus.Open(context.Background(), cfg, db)
	require.ErrorContains(t, err, "the *sql.DB uses the database/sql driver *pq.Driver, not pgx/v5's")
	require.ErrorContains(t, err, `sql.Open("pgx", url)`)
	require.ErrorContains(t, err, "pass bus.Open a *pgxpool.Pool")
	require.ErrorContains(t, bus.Migrate(context.Background(), (*pgxpool.Pool)(nil), cfg), "Migrate needs a database")
}
