package faults

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/ops"
)

// aggregates is how many aggregates a world's events are spread over.
const aggregates = 20

// writer is the service: it commits events of aggregates agg-0..agg-19 with
// increasing versions, ten per transaction; every 25th transaction rolls
// back. Through a database outage it keeps trying; a transaction whose
// COMMIT failed is uncertain until the check looks for it in the outbox.
type writer struct {
	w           *world
	poisonEvery int // every n-th event is malformed (0: none)

	mu         sync.Mutex
	committed  map[string]bool // well-formed events committed
	malformed  map[string]bool // malformed events committed
	rolledBack map[string]bool
	uncertain  map[string]bool // COMMIT failed: committed or not
	bad        map[string]bool // malformed among the uncertain
	version    map[string]int
	txn, seq   int
	failures   int // transactions that failed (database unreachable)
	// pacedAt is when the COMMIT of each event committed at a rate (start)
	// was sent, for the commit-to-effect latency.
	pacedAt map[string]time.Time
	// xids holds the transaction id of each uncertain event when the
	// world's relay deletes the rows it forwarded (relay.source: wal):
	// resolve asks PostgreSQL whether it committed, as the outbox no
	// longer tells.
	xids map[string]string
}

func newWriter(w *world) *writer {
	return &writer{w: w, committed: map[string]bool{}, malformed: map[string]bool{}, rolledBack: map[string]bool{},
		uncertain: map[string]bool{}, bad: map[string]bool{}, version: map[string]int{}, pacedAt: map[string]time.Time{},
		xids: map[string]string{}}
}

// commitTx writes one transaction of ten events; it reports false when the
// database refused it before COMMIT (nothing was written). paced notes the
// time of the COMMIT of its events (in pacedAt).
func (wr *writer) commitTx(ctx context.Context, paced bool) bool {
	wr.mu.Lock()
	txn := wr.txn
	rollback := txn%25 == 24
	versions := map[string]int{}
	var events []bus.Event
	bad := map[string]bool{}
	for i := range 10 {
		agg := fmt.Sprintf("agg-%d", (txn*10+i)%aggregates)
		if rollback {
			agg = "ghost-" + agg
		}
		versions[agg] = wr.version[agg] + 1 // ten distinct aggregates per transaction
		wr.seq++
		n := wr.seq
		if wr.poisonEvery > 0 && wr.seq%wr.poisonEvery == 0 {
			n = 0
		}
		body, _ := json.Marshal(payload{N: n})
		id := watermill.NewUUID()
		bad[id] = n == 0
		events = append(events, bus.Event{ID: id, Type: "Counted", AggregateType: "counter", AggregateID: agg,
			AggregateVersion: int64(versions[agg]), Payload: body})
	}
	wr.mu.Unlock()

	tx, err := wr.w.db.BeginTx(ctx, nil)
	var xid string
	if err == nil {
		err = wr.w.bus.Publish(ctx, tx, wr.w.topic, events...)
		if err == nil && wr.w.cfg.Relay.Source == forwarder.SourceWAL {
			err = tx.QueryRowContext(ctx, `SELECT pg_current_xact_id()::text`).Scan(&xid)
		}
		if err != nil {
			_ = tx.Rollback()
		}
	}
	if err != nil {
		wr.mu.Lock()
		wr.failures++
		wr.mu.Unlock()
		return false
	}
	committing := time.Now()
	if rollback {
		_ = tx.Rollback()
	} else {
		err = tx.Commit()
	}
	wr.mu.Lock()
	defer wr.mu.Unlock()
	wr.txn++
	for agg, v := range versions {
		wr.version[agg] = v
	}
	for _, ev := range events {
		switch {
		case rollback:
			wr.rolledBack[ev.ID] = true
		case err != nil:
			wr.uncertain[ev.ID] = true
			wr.bad[ev.ID] = bad[ev.ID]
			if xid != "" {
				wr.xids[ev.ID] = xid
			}
		case bad[ev.ID]:
			wr.malformed[ev.ID] = true
		default:
			wr.committed[ev.ID] = true
			if paced {
				wr.pacedAt[ev.ID] = committing
			}
		}
	}
	if err != nil {
		wr.failures++
	}
	return true
}

// commit commits transactions until n more events are committed.
func (wr *writer) commit(n int) {
	target := wr.total() + n
	for wr.total() < target {
		if !wr.commitTx(context.Background(), false) {
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// start commits about rate events per second until the returned stop is
// called; stop returns once the writer has stopped.
func (wr *writer) start(rate int) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(time.Second * 10 / time.Duration(rate))
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				if !wr.commitTx(context.Background(), true) {
					time.Sleep(100 * time.Millisecond)
				}
			}
		}
	}()
	return func() { cancel(); <-done }
}

// total is how many events were committed or may have been.
func (wr *writer) total() int {
	wr.mu.Lock()
	defer wr.mu.Unlock()
	return len(wr.committed) + len(wr.malformed) + len(wr.uncertain)
}

// resolve settles the uncertain events: those in the outbox committed.
func (wr *writer) resolve(t *testing.T) {
	wr.mu.Lock()
	defer wr.mu.Unlock()
	if len(wr.uncertain) == 0 {
		return
	}
	ids := make([]string, 0, len(wr.uncertain))
	xids := make([]string, 0, len(wr.uncertain))
	for id := range wr.uncertain {
		ids = append(ids, id)
		xids = append(xids, wr.xids[id])
	}
	// In the outbox, or of a transaction PostgreSQL says committed.
	rows, err := wr.w.db.Query(`SELECT uuid FROM "`+wr.w.cfg.Database.Schema+`".watermill_`+wr.w.cfg.Outbox.Topic+
		` WHERE uuid = ANY($1) UNION SELECT u.id FROM unnest($1::text[], $2::text[]) AS u(id, xid)
		WHERE CASE WHEN u.xid = '' THEN false ELSE pg_xact_status(u.xid::xid8) = 'committed' END`, ids, xids)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		if wr.bad[id] {
			wr.malformed[id] = true
		} else {
			wr.committed[id] = true
		}
		delete(wr.uncertain, id)
	}
	require.NoError(t, rows.Err())
	for id := range wr.uncertain { // not in the outbox: rolled back
		wr.rolledBack[id] = true
	}
	wr.uncertain = map[string]bool{}
}

// outcome is what a scenario's check found.
type outcome struct {
	committed, malformed, rolledBack int
	effects                          int // effect rows
	lost, duplicated, ghosts         int
	outOfOrder                       int
	poisoned, wronglyPoisoned        int
	// transactions is how many inbox transactions committed effects, and
	// largestBatch the most effects one of them committed.
	transactions, largestBatch int
}

// plus is what o and p found together, for a scenario of two worlds.
func (o outcome) plus(p outcome) outcome {
	return outcome{
		committed: o.committed + p.committed, malformed: o.malformed + p.malformed, rolledBack: o.rolledBack + p.rolledBack,
		effects: o.effects + p.effects, lost: o.lost + p.lost, duplicated: o.duplicated + p.duplicated, ghosts: o.ghosts + p.ghosts,
		outOfOrder: o.outOfOrder + p.outOfOrder, poisoned: o.poisoned + p.poisoned, wronglyPoisoned: o.wronglyPoisoned + p.wronglyPoisoned,
		transactions: o.transactions + p.transactions, largestBatch: max(o.largestBatch, p.largestBatch),
	}
}

// perTransaction is the mean effects per inbox transaction.
func (o outcome) perTransaction() float64 {
	if o.transactions == 0 {
		return 0
	}
	return float64(o.effects) / float64(o.transactions)
}

// stallWindow is how long settle lets a flow go without a new effect
// once its timeout has passed.
const stallWindow = 30 * time.Second

// settle waits until every committed well-formed event has an effect and
// every malformed one is in the poison table, and returns how long that
// took after the last fault (see settleWhen).
func (w *world) settle(timeout time.Duration) time.Duration {
	w.t.Helper()
	w.writer.resolve(w.t)
	want, bad := len(w.writer.committed), len(w.writer.malformed)
	return w.settleWhen(timeout, func() (progress, error) {
		var effects, poisoned int
		err := w.db.QueryRow(`SELECT (SELECT count(DISTINCT event_id) FROM `+w.table("effects")+`),
			(SELECT count(*) FROM `+w.table("millrace_poison")+`)`).Scan(&effects, &poisoned)
		return progress{applied: effects + poisoned, done: effects >= want && poisoned >= bad,
			state: fmt.Sprintf("%d of %d events have an effect, %d of %d malformed ones are poisoned", effects, want, poisoned, bad)}, err
	})
}

// progress is how far a flow has come, as settleWhen polls it.
type progress struct {
	applied int    // effects and poisoned messages so far
	done    bool   // the flow has settled
	state   string // what it has and awaits, for a failure message
}

// settleWhen polls poll until it reports done, and returns how long that
// took after the last fault. It fails after timeout, unless effects are
// still being added (one in the last stallWindow): a loaded machine may
// take longer over the same work, up to twice timeout, but a stalled flow
// fails at timeout.
func (w *world) settleWhen(timeout time.Duration, poll func() (progress, error)) time.Duration {
	w.t.Helper()
	began := time.Now()
	lastGrew, grown := began, -1
	// samples keeps a minute of progress, so that a failure tells a
	// stalled flow from a slow one.
	type sample struct {
		at      time.Time
		applied int
	}
	var samples []sample
	for {
		p, err := poll()
		if err == nil && p.done {
			break
		}
		w.nodesAlive()
		now := time.Now()
		samples = append(samples, sample{now, p.applied})
		for len(samples) > 1 && now.Sub(samples[0].at) > time.Minute {
			samples = samples[1:]
		}
		if p.applied > grown {
			lastGrew, grown = now, p.applied
		}
		elapsed := now.Sub(began)
		if elapsed > 2*timeout || (elapsed > timeout && now.Sub(lastGrew) > stallWindow) {
			w.t.Fatalf("after %s: %s (%d applied in the last %s, the last one %s ago); outbox: %s; relay cursor: %s (last error: %v)\n%s",
				elapsed.Round(time.Second), p.state, p.applied-samples[0].applied, now.Sub(samples[0].at).Round(time.Second),
				now.Sub(lastGrew).Round(time.Second), w.outboxState(), w.cursorState(), err, w.diagnose())
		}
		time.Sleep(50 * time.Millisecond)
	}
	settled := time.Now()
	// Late duplicates would show up now: give redeliveries in flight a moment.
	time.Sleep(2 * time.Second)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.lastFault.IsZero() {
		return 0
	}
	return settled.Sub(w.lastFault)
}

// outboxState says how many events the relay has not forwarded yet, for
// failure messages.
func (w *world) outboxState() string {
	oc, err := ops.New(context.Background(), w.db, w.cfg)
	if err != nil {
		return err.Error()
	}
	st, err := oc.OutboxStatus(context.Background(), w.cfg.Relay.ConsumerGroup)
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("%d pending, the oldest %s old, %d quarantined", st.Pending, st.OldestPendingAge.Round(time.Second), st.Quarantined)
}

// cursorState shows the relay's cursor row (millrace_relay_cursors): its
// position and its lease, for failure messages and logs.
func (w *world) cursorState() string {
	var offset int64
	var pending, done, horizon, holder string
	var fence int64
	var leaseUntil, acked sql.NullTime
	err := w.db.QueryRow(`SELECT read_offset, pending_xids::text, pending_done::text, horizon::text, fence, holder,
		CASE WHEN lease_until = '-infinity' THEN NULL ELSE lease_until END, acked_at FROM `+w.table("millrace_relay_cursors")+`
		WHERE outbox_topic = $1 AND consumer_group = $2`, w.cfg.Outbox.Topic, w.cfg.Relay.ConsumerGroup).
		Scan(&offset, &pending, &done, &horizon, &fence, &holder, &leaseUntil, &acked)
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("read_offset %d, pending_xids %s (done %s), horizon %s, fence %d, holder %q, lease_until %s, acked_at %s",
		offset, pending, done, horizon, fence, holder, timeOrNone(leaseUntil), timeOrNone(acked))
}

func timeOrNone(t sql.NullTime) string {
	if !t.Valid {
		return "none"
	}
	return t.Time.Format("15:04:05.000")
}

func (w *world) table(name string) string { return `"` + w.cfg.Database.Schema + `".` + name }

// check compares the effects with what the writer committed, asserts the
// guarantees (order only when ordered), and returns what it found.
func (w *world) check(ordered bool) outcome {
	t := w.t
	t.Helper()
	wr := w.writer
	o := outcome{committed: len(wr.committed), malformed: len(wr.malformed), rolledBack: len(wr.rolledBack)}
	rows, err := w.db.Query(`SELECT event_id, aggregate_id, version FROM ` + w.table("effects") + ` ORDER BY seq`)
	require.NoError(t, err)
	defer rows.Close()
	seen := map[string]int{}
	last := map[string]int64{}
	for rows.Next() {
		var id, agg string
		var version int64
		require.NoError(t, rows.Scan(&id, &agg, &version))
		o.effects++
		seen[id]++
		if seen[id] == 2 {
			o.duplicated++
		}
		if wr.rolledBack[id] {
			o.ghosts++
		}
		if version <= last[agg] {
			o.outOfOrder++
		}
		last[agg] = version
	}
	require.NoError(t, rows.Err())
	require.NoError(t, w.db.QueryRow(`SELECT count(*), coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM `+
		w.table("effects")+` GROUP BY xid) AS batches`).Scan(&o.transactions, &o.largestBatch))
	for id := range wr.committed {
		if seen[id] == 0 {
			o.lost++
		}
	}
	poisoned := map[string]bool{}
	prow, err := w.db.Query(`SELECT event_id FROM ` + w.table("millrace_poison"))
	require.NoError(t, err)
	defer prow.Close()
	for prow.Next() {
		var id string
		require.NoError(t, prow.Scan(&id))
		poisoned[id] = true
	}
	require.NoError(t, prow.Err())
	o.poisoned = len(poisoned)
	for id := range poisoned {
		if !wr.malformed[id] {
			o.wronglyPoisoned++
		}
	}
	for id := range wr.malformed {
		if !poisoned[id] {
			o.lost++ // a malformed event must reach the poison table
		}
	}

	t.Logf("%d effects in %d inbox transactions (%.1f per transaction, at most %d)", o.effects, o.transactions, o.perTransaction(), o.largestBatch)
	require.Zero(t, o.lost, "committed events without an effect (or malformed ones not poisoned)")
	require.Zero(t, o.duplicated, "events with more than one effect")
	require.Zero(t, o.ghosts, "effects of rolled-back events")
	require.Zero(t, o.wronglyPoisoned, "well-formed events poisoned")
	if ordered {
		require.Zero(t, o.outOfOrder, "effects of an aggregate out of version order")
	}
	return o
}
