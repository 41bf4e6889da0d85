package bus_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/ops"
)

func (tb testBundle) tables() store.Tables {
	return store.Tables{Schema: tb.schema, OutboxTopic: tb.cfg.Outbox.Topic}
}

func (tb testBundle) scheduledCount(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, tb.db.QueryRow(`SELECT count(*) FROM `+tb.tables().ScheduledTable()).Scan(&n))
	return n
}

// A due time that cannot be used is refused with a *ScheduleError naming
// the field, and so is an event Publish would refuse; nothing is written.
func TestScheduleRefusesBadInput(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tx := tb.begin(t)
	defer tx.Rollback()

	for _, c := range []struct {
		when  bus.When
		field string
	}{
		{bus.DueAt(time.Time{}), "At"},
		{bus.DueIn(-time.Second), "Delay"},
		{bus.When{}, "When"},
		{bus.DueAt(time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)), "At"},
	} {
		_, err := tb.bus.Schedule(ctx, tx, "orders.events", c.when, orderCreated("o-1"))
		var se *bus.ScheduleError
		require.ErrorAs(t, err, &se, c.field)
		require.Equal(t, c.field, se.Field)
		require.ErrorIs(t, err, bus.ErrInvalidSchedule)
		require.True(t, bus.IsPermanent(err))
	}
	bad := orderCreated("o-1")
	bad.AggregateID = ""
	_, err := tb.bus.Schedule(ctx, tx, "orders.events", bus.DueIn(time.Minute), orderCreated("o-2"), bad)
	var ee *bus.EventError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, "AggregateID", ee.Field)
	require.Equal(t, 1, ee.Index)
	_, err = tb.bus.Schedule(ctx, nil, "orders.events", bus.DueIn(time.Minute), orderCreated("o-1"))
	require.ErrorIs(t, err, bus.ErrNilTx)
	twice := orderCreated("o-1")
	twice.ID = "evt-twice"
	_, err = tb.bus.Schedule(ctx, tx, "orders.events", bus.DueIn(time.Minute), twice, twice)
	require.ErrorAs(t, err, &ee)
	require.Equal(t, "ID", ee.Field)
	require.Equal(t, 1, ee.Index)
	require.NoError(t, tx.Commit())
	require.Zero(t, tb.scheduledCount(t), "nothing is written on an error")

	// The id of an event scheduled already.
	tx, err = tb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tb.bus.Schedule(ctx, tx, "orders.events", bus.DueIn(time.Minute), twice)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	tx, err = tb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback()
	_, err = tb.bus.Schedule(ctx, tx, "orders.events", bus.DueIn(time.Minute), twice)
	require.ErrorIs(t, err, bus.ErrAlreadyScheduled)
}

// A scheduled event becomes, once due, exactly the outbox row Publish
// writes for it; one scheduled in a transaction that rolls back never
// exists; events due at the same time enter the outbox in the order given.
func TestScheduledEventEntersTheOutboxAsPublishWritesIt(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	event := orderCreated("o-1")
	event.ID = "evt-1"
	event.OccurredAt = time.Date(2026, 3, 4, 5, 6, 7, 8, time.UTC)
	event.Metadata = map[string]string{"tenant": "acme", "note": "ü \"quoted\"\n"}

	tx := tb.begin(t)
	require.NoError(t, tb.bus.Publish(ctx, tx, "orders.events", event))
	require.NoError(t, tx.Commit())

	tx = tb.begin(t)
	_, err := tb.bus.Schedule(ctx, tx, "orders.events", bus.DueIn(0), orderCreated("ghost"))
	require.NoError(t, err)
	require.NoError(t, tx.Rollback())

	second := event
	second.ID = "evt-2"
	tx, err = tb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	ids, err := tb.bus.Schedule(ctx, tx, "orders.events", bus.DueAt(time.Now().Add(-time.Second)), event, second)
	require.NoError(t, err)
	require.Equal(t, []string{"evt-1", "evt-2"}, ids)
	require.NoError(t, tx.Commit())

	moved, _, more, err := tb.tables().MoveDue(ctx, tb.db, 100)
	require.NoError(t, err)
	require.Equal(t, 2, moved)
	require.False(t, more, "nothing is left scheduled")

	rows, err := tb.db.Query(`SELECT uuid, payload::text, metadata::text FROM ` + tb.tables().OutboxTable() + ` ORDER BY transaction_id, "offset"`)
	require.NoError(t, err)
	defer rows.Close()
	var got [][3]string
	for rows.Next() {
		var r [3]string
		require.NoError(t, rows.Scan(&r[0], &r[1], &r[2]))
		got = append(got, r)
	}
	require.NoError(t, rows.Err())
	require.Len(t, got, 3)
	require.Equal(t, got[0], got[1], "the scheduled row is the published one, byte for byte")
	require.Equal(t, "evt-2", got[2][0], "events due at once keep the order they were given in")
}

// CancelScheduled deletes a scheduled event in the caller's transaction (a
// rollback keeps it) and returns ErrNotScheduled for an unknown id, one
// cancelled already, and one moved into the outbox; on pgx too, and for a
// typed topic.
func TestCancelScheduled(t *testing.T) {
	t.Parallel()
	pb := setupPgx(t)
	tb := pb.testBundle
	ctx := context.Background()
	placed := bus.Must(bus.NewTopic[placedV2]("orders.events", bus.Version(2)))

	tx := tb.begin(t)
	later, err := placed.Schedule(ctx, tb.bus, tx, bus.DueIn(time.Hour), placedV2{OrderID: "o-1"}, placedV2{OrderID: "o-2"})
	require.NoError(t, err)
	due, err := tb.bus.Schedule(ctx, tx, "orders.events", bus.DueIn(0), orderCreated("o-3"))
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	ptx := pb.beginPgx(t)
	viaPgx, err := placed.Schedule(ctx, pb.pgx, bus.Pgx(ptx), bus.DueIn(time.Hour), placedV2{OrderID: "o-4"})
	require.NoError(t, err)
	require.NoError(t, ptx.Commit(ctx))
	require.Equal(t, 4, tb.scheduledCount(t))

	_, _, _, err = tb.tables().MoveDue(ctx, tb.db, 100)
	require.NoError(t, err)
	cancel := func(id string) error {
		tx := tb.begin(t)
		if err := tb.bus.CancelScheduled(ctx, tx, id); err != nil {
			_ = tx.Rollback()
			return err
		}
		return tx.Commit()
	}
	require.ErrorIs(t, cancel(due[0]), bus.ErrNotScheduled, "a due event moved into the outbox")
	require.ErrorIs(t, cancel("no-such-id"), bus.ErrNotScheduled)

	tx, err = tb.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tb.bus.CancelScheduled(ctx, tx, later[0]))
	require.NoError(t, tx.Rollback())
	require.Equal(t, 3, tb.scheduledCount(t), "a rolled-back cancel keeps the event")

	require.NoError(t, cancel(later[0]))
	require.ErrorIs(t, cancel(later[0]), bus.ErrNotScheduled, "cancelled already")
	ptx = pb.beginPgx(t)
	require.NoError(t, pb.pgx.CancelScheduled(ctx, bus.Pgx(ptx), viaPgx[0]))
	require.NoError(t, ptx.Commit(ctx))

	oc, err := ops.New(ctx, tb.db, tb.cfg)
	require.NoError(t, err)
	list, err := oc.ListScheduled(ctx, 0)
	require.NoError(t, err)
	require.Equal(t, int64(1), list.Total)
	require.Len(t, list.Events, 1)
	require.Equal(t, later[1], list.Events[0].ID)
	require.Equal(t, "OrderPlaced", list.Events[0].Type)
	require.Equal(t, "o-2", list.Events[0].AggregateID)
	byID, err := oc.ScheduledEvents(ctx, later[0], later[1], due[0], "no-such-id")
	require.NoError(t, err)
	require.Equal(t, list.Events, byID, "only the ids still scheduled: not the cancelled, the due nor the unknown")
	none, err := oc.ScheduledEvents(ctx)
	require.NoError(t, err)
	require.Empty(t, none)
	require.NoError(t, oc.CancelScheduled(ctx, later[1]))
	err = oc.CancelScheduled(ctx, later[1])
	require.True(t, errors.Is(err, bus.ErrNotScheduled), "%v", err)
	require.Zero(t, tb.scheduledCount(t))
}
