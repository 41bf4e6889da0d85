package forwarder_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// Two relays and the publishing service reach PostgreSQL only through
// PgBouncer in transaction mode, in each query exec mode that is safe
// there (describe_exec is not: pgx sends its two round trips to whichever
// server connection the pooler gives, and so may run another client's
// statement with its arguments). Notifications do not reach them, so they
// poll; one holds the lease and forwards every event in order; when it
// stops, the other takes over and forwards the rest.
func TestRelaysWorkThroughPgBouncerInTransactionMode(t *testing.T) {
	t.Parallel()
	bouncer := servers.StartPgBouncer(t, testdb.URL())
	for _, mode := range []string{"exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			testThroughPooler(t, bouncer.URL("postgres")+"&default_query_exec_mode="+mode)
		})
	}
}

func testThroughPooler(t *testing.T, pooled string) {
	tb := setup(t)
	db, err := sql.Open("pgx", pooled)
	require.NoError(t, err)
	defer db.Close()
	ctx := context.Background()
	b, err := bus.Open(ctx, tb.cfg, db)
	require.NoError(t, err)
	defer b.Close()
	tb.db, tb.bus = db, b

	broker := newMemoryBroker()
	cfg := testConfig()
	cfg.LeaseTTL = time.Second
	relays := make([]*forwarder.Forwarder, 2)
	stops := make([]context.CancelFunc, 2)
	for i := range relays {
		f, err := forwarder.New(db, broker, tb.outbox, cfg, forwarder.Options{})
		require.NoError(t, err)
		relays[i], stops[i] = f, run(t, f)
	}
	// Each relay knows its role once it has opened its notifier, which
	// decides whether it polls: the standby may still be opening its own
	// when the other takes the lease.
	active := -1
	testkit.Eventually(t, waitLimit, "a relay to hold the lease and the other to know its role", func() bool {
		known := true
		for i, f := range relays {
			switch f.Status().Role {
			case forwarder.RoleActive:
				active = i
			case forwarder.RoleStarting:
				known = false
			}
		}
		return active >= 0 && known
	})
	for _, f := range relays {
		require.True(t, f.Status().Polling, "notifications do not pass the pooler: the relays poll")
	}
	publish(t, tb, "things", interleaved(4, 25), 10)
	testkit.Eventually(t, waitLimit, "every event through the pooler", func() bool { return len(broker.snapshot()) == 100 })
	require.Equal(t, forwarder.RoleStandby, relays[1-active].Status().Role, "one relay holds the lease")

	stops[active]()
	testkit.Eventually(t, waitLimit, "the standby to take over", func() bool {
		return relays[1-active].Status().Role == forwarder.RoleActive
	})
	more := interleaved(4, 50)[100:]
	publish(t, tb, "things", more, 10)
	testkit.Eventually(t, waitLimit, "the rest, from the new leader", func() bool { return len(broker.snapshot()) >= 200 })
	checkOrder(t, broker.snapshot(), 4, 50)
}
