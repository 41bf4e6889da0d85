package faults

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// The scenarios of a PostgreSQL shared as production shares it: what a
// relay must not wait on (another session's open transaction, another
// service's broker), and a pooler in transaction mode.
const (
	idleInTransaction = "a session idle in transaction for 60 s, holding a transaction id and an event of its own"
	neighbourFrozen   = "another service's broker frozen 20 s (SIGSTOP), same PostgreSQL"
	pooledRelays      = "relays and consumer through PgBouncer (transaction mode, polling), the active relay SIGKILLed"
)

// holdFor is how long TestIdleInTransaction keeps its transaction open.
const holdFor = 60 * time.Second

// baselineFor is how long a scenario lets the flow run before its fault,
// for the commit-to-effect latency without the fault.
const baselineFor = 5 * time.Second

// TestIdleInTransaction leaves a transaction open and idle on the
// service's database for holdFor while the service commits events at the
// suite's rate: a session of another part of the service that began,
// wrote (so it has a transaction id, and one event in the outbox at an
// offset below everything committed after it) and stalled. The relay
// forwards the events committed meanwhile as it does without it, and the
// held event once its transaction commits. Each world has a PostgreSQL of
// its own, so that the open transaction holds back no relay of another
// test; a control world runs the same flow at the same time without the
// open transaction, for the latency without it under the same load.
func TestIdleInTransaction(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		w := newWorld(t, kind, worldOptions{databaseURL: servers.StartPostgreSQL(t).URL})
		control := newWorld(t, kind, worldOptions{databaseURL: servers.StartPostgreSQL(t).URL})
		for _, x := range []*world{w, control} {
			x.start("relay", nodeSpec{Relay: true})
			x.start("consumer", nodeSpec{Consume: true})
		}
		stop, stopControl := w.writer.start(rate), control.writer.start(rate)
		w.flowing(200)
		control.flowing(200)
		h := w.holdTransaction()
		w.fault()
		time.Sleep(holdFor)
		state, open := h.activity()
		deadVersions := w.deadVersions("millrace_relay_cursors")
		require.Equal(t, "idle in transaction", state, "the held session is idle in its transaction")
		applied := w.latency(h.began, time.Now()).events
		require.Positive(t, applied, "events committed during the hold had their effect while it was open (relay cursor: %s)", w.cursorState())
		committed := h.commit()
		w.fault()
		time.Sleep(2 * time.Second)
		stop()
		stopControl()
		recovery := w.settle(settleTimeout)
		control.settle(settleTimeout)
		o := w.check(true)
		control.check(true)
		held := w.effectTimes()[h.event.ID].Sub(committed)
		during := w.latency(h.began, committed)
		const part = holdFor / 6 // 10 s
		w.record(result{scenario: idleInTransaction, broker: kind, faults: fmt.Sprintf("1 transaction open %s", open.Round(100*time.Millisecond)),
			o: o, ordered: true, recovery: recovery, latency: during,
			note: fmt.Sprintf("commit to effect of the %d events committed during the hold: %s (%d of them applied before it ended; "+
				"in its first %s: %s, in its last %s: %s); the same flow at the same time on a PostgreSQL of its own without the open "+
				"transaction: %s; the held transaction's own event was applied %s after its COMMIT; the relay's one-row cursor table "+
				"had %d dead row versions at the end of the hold, which vacuum cannot remove while it lasts; relay cursor at the end: %s",
				during.events, during, applied, part, w.latency(h.began, h.began.Add(part)), part, w.latency(committed.Add(-part), committed),
				control.latency(h.began, committed), roughly(held), deadVersions, w.cursorState())})
	})
}

// heldTransaction is a transaction left open, idle, on the service's
// database.
type heldTransaction struct {
	w     *world
	tx    *sql.Tx
	pid   int
	event bus.Event
	began time.Time
}

// holdTransaction begins a transaction that inserts a row into a table of
// its own (taking a transaction id) and publishes one event, of an
// aggregate of its own, and leaves it open.
func (w *world) holdTransaction() *heldTransaction {
	t := w.t
	t.Helper()
	ctx := context.Background()
	_, err := w.db.Exec(`CREATE TABLE ` + w.table("unrelated") + ` (id BIGINT)`)
	require.NoError(t, err)
	tx, err := w.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() }) // when the test failed during the hold
	h := &heldTransaction{w: w, tx: tx, began: time.Now(), event: bus.Event{ID: watermill.NewUUID(), Type: "Counted",
		AggregateType: "counter", AggregateID: "held", AggregateVersion: 1, Payload: []byte(`{"n":-1}`)}}
	require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&h.pid))
	_, err = tx.ExecContext(ctx, `INSERT INTO `+w.table("unrelated")+` VALUES (1)`)
	require.NoError(t, err)
	require.NoError(t, w.bus.Publish(ctx, tx, w.topic, h.event))
	return h
}

// activity returns the held session's state in pg_stat_activity and how
// long its transaction has been open; the test fails unless the
// transaction has an id.
func (h *heldTransaction) activity() (state string, open time.Duration) {
	h.w.t.Helper()
	var xid sql.NullString
	var seconds float64
	require.NoError(h.w.t, h.w.db.QueryRow(`SELECT state, backend_xid::text, extract(epoch FROM clock_timestamp() - xact_start)::float8
		FROM pg_stat_activity WHERE pid = $1`, h.pid).Scan(&state, &xid, &seconds))
	require.True(h.w.t, xid.Valid, "the held transaction has a transaction id")
	return state, time.Duration(seconds * float64(time.Second))
}

// deadVersions returns the dead row versions of the world's table name
// that PostgreSQL counts (pg_stat_user_tables, as of its last statistics
// flush, within a second).
func (w *world) deadVersions(name string) int64 {
	w.t.Helper()
	var dead int64
	require.NoError(w.t, w.db.QueryRow(`SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2`,
		w.cfg.Database.Schema, name).Scan(&dead))
	return dead
}

// commit commits the held transaction, adds its event to what the writer
// committed, and returns when the COMMIT was sent.
func (h *heldTransaction) commit() time.Time {
	h.w.t.Helper()
	committing := time.Now()
	require.NoError(h.w.t, h.tx.Commit())
	h.w.writer.mu.Lock()
	defer h.w.writer.mu.Unlock()
	h.w.writer.committed[h.event.ID] = true
	return committing
}

// neighbourOutageFor is how long TestNeighbourBrokerFrozen keeps the other
// service's broker frozen.
const neighbourOutageFor = 20 * time.Second

// TestNeighbourBrokerFrozen runs two services on one PostgreSQL (the
// shared server; a schema, an outbox and a relay each): A on a private
// broker, which is frozen (SIGSTOP; kfake: every request held) for
// neighbourOutageFor while A commits events, and B on the shared broker,
// committing at the suite's rate. B's events are not held back by A's
// relay waiting on its broker; A's arrive once its broker is back.
func TestNeighbourBrokerFrozen(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		broker := startFreezableBroker(t, kind)
		a := newWorld(t, kind, worldOptions{brokerURL: broker.url, unordered: true, tune: broker.tune})
		b := newWorld(t, kind, worldOptions{unordered: true})
		for _, w := range []*world{a, b} {
			w.start("relay", nodeSpec{Relay: true})
			w.start("consumer", nodeSpec{Consume: true})
		}
		stopA, stopB := a.writer.start(rate/2), b.writer.start(rate)
		a.flowing(100)
		b.flowing(200)
		steady := time.Now()
		time.Sleep(baselineFor)
		var began, ended time.Time
		var flowedB, flowedA int
		broker.outage(a, neighbourOutageFor, func(frozenAt time.Time) {
			began, ended = frozenAt, time.Now()
			flowedB, flowedA = b.latency(began, ended).events, a.latency(began, ended).events
		})
		a.fault()
		require.Positive(t, flowedB, "B's events committed while A's broker was frozen had their effect meanwhile")
		require.Zero(t, flowedA, "A's broker was frozen: none of A's events committed meanwhile had an effect")
		time.Sleep(3 * time.Second)
		stopA()
		stopB()
		recovery := a.settle(settleTimeout)
		b.settle(settleTimeout)
		oa, ob := a.check(false), b.check(false)
		duringB, duringA := b.latency(began, ended), a.latency(began, ended)
		a.record(result{scenario: neighbourFrozen, broker: kind, faults: fmt.Sprintf("A's broker frozen %s", ended.Sub(began).Round(100*time.Millisecond)),
			o: oa.plus(ob), recovery: recovery, latency: duringB,
			note: fmt.Sprintf("service A (%d events/s, %s) and service B (%d events/s, the shared broker), their relays on the same PostgreSQL: "+
				"commit to effect of the %d events B committed during A's outage: %s (in the %s before it: %s); A's %d events committed during "+
				"the outage: %s, all applied %s after its broker returned; at A, %s; at B, %s",
				rate/2, broker.what, rate, duringB.events, duringB, baselineFor, b.latency(steady, began), duringA.events, duringA,
				roughly(recovery), a.clientLogs(), b.clientLogs())})
	})
}

// freezableBroker is a private broker that a test freezes, as SIGSTOP
// freezes a process: connections stay open and nothing is answered.
type freezableBroker struct {
	url          string            // a private NATS or RabbitMQ server's URL
	tune         func(*bus.Config) // points the config at a private Kafka cluster
	freeze, thaw func()
	what         string // how it is frozen, for the report
}

// startFreezableBroker starts a private broker of kind: a nats-server or a
// RabbitMQ node that freeze SIGSTOPs, or a kfake cluster whose every
// request freeze holds until thaw.
func startFreezableBroker(t *testing.T, kind string) freezableBroker {
	t.Helper()
	switch kind {
	case bus.KindNATS:
		s := servers.StartNATS(t)
		return freezableBroker{url: s.URL, freeze: s.Pause, thaw: s.Resume, what: "a private nats-server, SIGSTOPped"}
	case bus.KindRabbitMQ:
		s := servers.StartRabbitMQ(t, "", "")
		return freezableBroker{url: s.URL, freeze: s.Pause, thaw: s.Resume, what: "a private RabbitMQ node, SIGSTOPped"}
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.ClusterID("millrace-neighbour"))
	require.NoError(t, err)
	t.Cleanup(c.Close)                       // wakes requests still held
	var thawed atomic.Pointer[chan struct{}] // non-nil while frozen
	c.Control(func(kmsg.Request) (kmsg.Response, error, bool) {
		if ch := thawed.Load(); ch != nil {
			c.SleepControl(func() { <-*ch })
		}
		return nil, nil, false // then kfake answers it as usual
	})
	addrs := c.ListenAddrs()
	return freezableBroker{
		tune: func(cfg *bus.Config) {
			cfg.Broker.Kafka.Brokers, cfg.Broker.Kafka.ReplicationFactor = addrs, 1
		},
		freeze: func() { ch := make(chan struct{}); thawed.Store(&ch) },
		thaw:   func() { close(*thawed.Swap(nil)) },
		what:   "a private kfake cluster holding every request unanswered",
	}
}

// outage freezes the broker for d, noting the fault in w, runs atEnd
// (given when the freeze began) while it is still frozen, and thaws it (on
// cleanup too, when the test fails meanwhile).
func (b freezableBroker) outage(w *world, d time.Duration, atEnd func(frozenAt time.Time)) {
	b.freeze()
	frozen := true
	w.t.Cleanup(func() {
		if frozen {
			b.thaw()
		}
	})
	w.fault()
	frozenAt := time.Now()
	time.Sleep(d)
	atEnd(frozenAt)
	b.thaw()
	frozen = false
}

// The PgBouncer scenario's relay settings: relays behind a pooler in
// transaction mode poll, and take over from a dead relay when its lease
// expires.
const (
	pooledPollInterval = 100 * time.Millisecond
	pooledLeaseTTL     = time.Second
)

// TestRelaysThroughPgBouncer runs the nodes and the service through a
// private PgBouncer in transaction mode (4 server connections) in front of
// a private PostgreSQL, with no database.direct_url: notifications do not
// reach the relays, which poll every pooledPollInterval and take over by
// lease expiry (pooledLeaseTTL). Two relays run; the one holding the lease
// is SIGKILLed at a random point, six times, and another started in its
// place. The relays run alternately in pgx's exec and simple_protocol
// query exec modes, the consumer in simple_protocol, the service in exec
// (describe_exec is not safe through such a pooler outside transactions).
func TestRelaysThroughPgBouncer(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		pooler := servers.StartPgBouncer(t, servers.StartPostgreSQL(t).URL)
		pooled, err := withQueryExecMode(pooler.URL("postgres"), "exec")
		require.NoError(t, err)
		w := newWorld(t, kind, worldOptions{databaseURL: pooled, tune: func(c *bus.Config) {
			c.Relay.PollInterval, c.Relay.LeaseTTL = pooledPollInterval, pooledLeaseTTL
		}})
		w.start("consumer", nodeSpec{Consume: true, QueryExecMode: "simple_protocol"})
		modes := []string{"exec", "simple_protocol"}
		relays := 0
		startRelay := func() *node {
			n := w.start(fmt.Sprint("relay-", relays), nodeSpec{Relay: true, QueryExecMode: modes[relays%2]})
			relays++
			return n
		}
		startRelay()
		startRelay()
		// A relay gives notifications probeTimeout (5s) to arrive before
		// it polls: the service starts once both poll.
		w.awaitPolling()
		stop := w.writer.start(rate)
		w.flowing(200)
		const kills = 6
		rng := newRand()
		var takeovers []time.Duration
		for i := range kills {
			if i > 0 {
				w.awaitPolling() // the relay started in the place of the last one killed
			}
			leader := w.leaseHolder()
			time.Sleep(time.Duration(300+rng.IntN(1200)) * time.Millisecond)
			killed := time.Now()
			leader.kill()
			w.fault()
			startRelay()
			takeovers = append(takeovers, w.awaitTakeover(leader, killed))
		}
		stop()
		recovery := w.settle(settleTimeout)
		w.record(result{scenario: pooledRelays, broker: kind, faults: fmt.Sprintf("%d SIGKILLs of the active relay", kills),
			o: w.check(true), ordered: true, recovery: recovery,
			note: fmt.Sprintf("relay.poll_interval %s, lease_ttl %s, no direct_url: every relay logged that notifications do not reach it "+
				"and polled; the service committed its events during the kills only; another relay held the lease %s after each kill; %s; %s",
				pooledPollInterval, pooledLeaseTTL, spread(takeovers), poolerWaits(t, pooler), w.clientLogs())})
	})
}

// poolerWaits says how long transactions waited for one of the pooler's
// server connections, on average (SHOW STATS of database postgres).
func poolerWaits(t *testing.T, pooler *servers.PgBouncer) string {
	t.Helper()
	stats, err := pooler.Show(context.Background(), "STATS")
	require.NoError(t, err)
	for _, row := range stats {
		if row["database"] != "postgres" {
			continue
		}
		xacts, err1 := strconv.ParseInt(row["total_xact_count"], 10, 64)
		waited, err2 := strconv.ParseInt(row["total_wait_time"], 10, 64) // microseconds
		require.NoError(t, errors.Join(err1, err2))
		return fmt.Sprintf("%d transactions through the pooler's %d server connections waited %s for one on average",
			xacts, servers.PgBouncerPoolSize, (time.Duration(waited/max(xacts, 1)) * time.Microsecond).Round(10*time.Microsecond))
	}
	t.Fatalf("the pooler's SHOW STATS has no row for database postgres: %v", stats)
	return ""
}

// spread says the shortest and longest of ds.
func spread(ds []time.Duration) string {
	lo, hi := ds[0], ds[0]
	for _, d := range ds {
		lo, hi = min(lo, d), max(hi, d)
	}
	return fmt.Sprintf("%s to %s", roughly(lo), roughly(hi))
}

// pollingNote is what a relay logs when notifications do not reach it.
const pollingNote = "Notifications do not reach the relay"

// awaitPolling waits until every live relay node has found that
// notifications do not reach it, and polls.
func (w *world) awaitPolling() {
	w.t.Helper()
	testkit.Eventually(w.t, time.Minute, "every relay to poll", func() bool {
		for _, n := range w.liveNodes() {
			if strings.HasPrefix(n.name, "relay") && !strings.Contains(n.stderr.String(), pollingNote) {
				return false
			}
		}
		return true
	})
}

// liveNodes returns the nodes the scenario has not ended.
func (w *world) liveNodes() []*node {
	var live []*node
	for _, n := range w.snapshot() {
		if !n.stopped.Load() {
			live = append(live, n)
		}
	}
	return live
}

// leaseHolder waits until a live node holds the relay's lease, and returns
// it.
func (w *world) leaseHolder() *node {
	w.t.Helper()
	var holder *node
	testkit.Eventually(w.t, 30*time.Second, "a live relay to hold the lease", func() bool {
		holder = w.liveHolder()
		return holder != nil
	})
	return holder
}

// awaitTakeover waits until a live relay other than killed holds the lease
// and returns how long after since that was; it fails, showing the cursor,
// after 30s.
func (w *world) awaitTakeover(killed *node, since time.Time) time.Duration {
	w.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if holder := w.liveHolder(); holder != nil && holder != killed {
			return time.Since(since)
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("no relay took the lease within 30s of the kill of %s; relay cursor: %s", killed.name, w.cursorState())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// liveHolder returns the live node whose relay holds an unexpired lease on
// the cursor; nil when none does.
func (w *world) liveHolder() *node {
	var holder string
	if err := w.db.QueryRow(`SELECT holder FROM `+w.table("millrace_relay_cursors")+`
		WHERE outbox_topic = $1 AND consumer_group = $2 AND lease_until > clock_timestamp()`,
		w.cfg.Outbox.Topic, w.cfg.Relay.ConsumerGroup).Scan(&holder); err != nil {
		return nil
	}
	// A holder is host-pid-suffix (the forwarder's instance id).
	fields := strings.Split(holder, "-")
	if len(fields) < 3 {
		return nil
	}
	pid, err := strconv.Atoi(fields[len(fields)-2])
	if err != nil {
		return nil
	}
	for _, n := range w.liveNodes() {
		if n.proc.Pid() == pid {
			return n
		}
	}
	return nil
}
