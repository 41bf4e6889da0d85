package faults

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
)

// The failover scenarios.
const (
	failoverSync  = "primary crashed, synchronous standby promoted"
	failoverAsync = "primary crashed, asynchronous standby promoted"
)

// TestFailoverToSynchronousStandby crashes the primary mid-flow and
// promotes its synchronous standby: every event whose COMMIT succeeded is
// on the new primary and has one effect there, and nothing the new primary
// lacks was delivered.
func TestFailoverToSynchronousStandby(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) { failover(t, kind, servers.Synchronous) })
}

// TestFailoverToAsynchronousStandby stops the asynchronous standby
// standbyLag before it crashes the primary mid-flow, then starts and
// promotes the standby, which lacks the primary's write-ahead log of
// those last moments: the events and effects committed in it. The
// scenario counts them (see failoverLoss) and requires that nothing else
// was lost and nothing applied twice.
func TestFailoverToAsynchronousStandby(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) { failover(t, kind, servers.Asynchronous) })
}

// standbyLag is how far behind the primary the asynchronous standby is
// when the primary crashes: on one machine it keeps up within
// milliseconds, and a crash would lose next to nothing.
const standbyLag = time.Second

// failoverLoss is what a failover to a standby lost, as the new primary
// shows it.
type failoverLoss struct {
	// events are the events whose COMMIT the service saw succeed that the
	// new primary lacks; uncertain those whose COMMIT failed at the crash
	// that it lacks too.
	events, uncertain int
	// delivered is how many of both a consumer applied nonetheless (they
	// were relayed from the old primary before the crash), and
	// deliveredHere how many of those have their effect on the new
	// primary (the others, on the old primary only, were lost with it).
	delivered, deliveredHere int
	// effects is how many events the new primary has whose effect a
	// consumer committed, and acked, on the old primary only.
	effects int
}

// failover runs the flow on a private primary with a streaming standby,
// every node and the service on the URL naming both (the primary first,
// target_session_attrs=read-write), crashes the primary (immediate stop)
// mid-flow, promotes the standby, and lets the nodes find it by
// themselves.
func failover(t *testing.T, kind string, mode servers.Replication) {
	// A standby whose primary is gone retries it every
	// wal_retrieve_retry_interval (5s), and a promotion waited for that
	// now and then.
	ps := servers.StartPrimaryStandby(t, mode, servers.PostgreSQLOptions{Conf: "wal_retrieve_retry_interval = 100ms\n"})
	w := newWorld(t, kind, worldOptions{databaseURL: ps.URL})
	w.start("relay", nodeSpec{Relay: true})
	w.start("consumer", nodeSpec{Consume: true, ReportEffects: true})
	stop := w.writer.start(rate)
	w.flowing(200)
	crashed, down, behind := w.crashAndPromote(ps, mode)
	w.moreEffects(200) // on the new primary
	stop()
	stopped := time.Now()
	vanished := w.writer.vanish(w.t)
	recovery := w.settleFailover()
	loss := w.failoverLoss(vanished)
	synchronous := mode == servers.Synchronous
	o := w.check(synchronous)
	scenario, how := failoverAsync, fmt.Sprintf("asynchronous replication, the standby stopped %s before the crash (%d bytes of WAL behind)", standbyLag, behind)
	faults := fmt.Sprintf("1 crash, the standby stopped %s before it, started and promoted %s after it", standbyLag, down.Round(100*time.Millisecond))
	if synchronous {
		require.Zero(t, loss.events, "a synchronous standby has every event whose COMMIT succeeded")
		require.Zero(t, loss.delivered, "nothing the synchronous standby lacks was delivered")
		require.Zero(t, loss.effects, "a synchronous standby has every effect a consumer committed")
		scenario, how = failoverSync, "synchronous replication"
		faults = fmt.Sprintf("1 crash, the standby promoted %s later", down.Round(100*time.Millisecond))
	}
	window := w.latency(crashed.Add(-2*time.Second), stopped)
	w.record(result{scenario: scenario, broker: kind, faults: faults, o: o, ordered: synchronous, recovery: recovery, latency: window,
		knownLoss: loss.known(),
		note: fmt.Sprintf("%s; commit to effect of the %d events committed from 2 s before the crash on: %s; %s; transactions whose COMMIT failed "+
			"at the crash that the new primary lacks: %d; relay cursor at the end: %s; %s", how, window.events, window, loss, loss.uncertain/10,
			w.cursorState(), w.clientLogs())})
}

// crashAndPromote crashes the primary and promotes the standby; with
// asynchronous replication it stops the standby standbyLag before the
// crash and starts it again after. It returns when the primary crashed,
// how long until the standby took writes, and how many bytes of the
// primary's write-ahead log the promoted standby lacks.
func (w *world) crashAndPromote(ps *servers.PrimaryStandby, mode servers.Replication) (crashed time.Time, down time.Duration, behind int64) {
	w.t.Helper()
	ctx := context.Background()
	if mode == servers.Asynchronous {
		ps.Standby.Stop()
		time.Sleep(standbyLag)
	}
	lsn, err := ps.Primary.WALPosition(ctx)
	require.NoError(w.t, err)
	crashed = time.Now()
	ps.Primary.Crash()
	w.fault()
	if mode == servers.Asynchronous {
		ps.Standby.Start()
	}
	ps.Standby.Promote()
	down = time.Since(crashed)
	w.fault()
	behind, err = ps.Behind(ctx, lsn)
	require.NoError(w.t, err)
	return crashed, down, behind
}

// String says what was lost, for the report.
func (l failoverLoss) String() string {
	if l.events == 0 && l.delivered == 0 && l.effects == 0 {
		return "the new primary had every event whose COMMIT had succeeded and every effect a consumer had committed, " +
			"and nothing it lacked was delivered"
	}
	return fmt.Sprintf("the new primary lacked %d events whose COMMIT had succeeded (the WAL the standby never received); "+
		"%d events it lacked had been relayed before the crash and applied: %d on the old primary only, %d on the new one; "+
		"it had %d events whose effect a consumer had committed (and acked) on the old primary only",
		l.events, l.delivered, l.delivered-l.deliveredHere, l.deliveredHere, l.effects)
}

// known says, for the Lost column, what the standby's missing WAL lost:
// "" when nothing.
func (l failoverLoss) known() string {
	if l.events == 0 && l.effects == 0 {
		return ""
	}
	return fmt.Sprintf("and %d events, %d effects in the WAL the standby never received", l.events, l.effects)
}

// failoverLoss counts what the failover lost, once the flow has settled:
// vanished are the events the new primary lacks (true: their COMMIT had
// succeeded). It takes out of the writer's committed events those whose
// effect is only on the old primary.
func (w *world) failoverLoss(vanished map[string]bool) failoverLoss {
	w.t.Helper()
	var l failoverLoss
	for _, committed := range vanished {
		if committed {
			l.events++
		} else {
			l.uncertain++
		}
	}
	l.effects = w.effectsLostWithOldPrimary()
	reported, applied := w.reportedEffects(), w.effectTimes()
	for id := range vanished {
		if reported[id] {
			l.delivered++
		}
		if _, ok := applied[id]; ok {
			l.deliveredHere++
		}
	}
	return l
}

// vanish takes out of the writer's events those the outbox lacks, and
// returns them: true for those whose COMMIT succeeded, false for those
// whose COMMIT failed. It resolves those whose COMMIT failed that the
// outbox has as committed.
func (wr *writer) vanish(t *testing.T) map[string]bool {
	t.Helper()
	wr.mu.Lock()
	defer wr.mu.Unlock()
	ids := make([]string, 0, len(wr.committed)+len(wr.uncertain))
	for _, set := range []map[string]bool{wr.committed, wr.uncertain} {
		for id := range set {
			ids = append(ids, id)
		}
	}
	rows, err := wr.w.db.Query(`SELECT uuid FROM "`+wr.w.cfg.Database.Schema+`".watermill_`+wr.w.cfg.Outbox.Topic+
		` WHERE uuid = ANY($1)`, ids)
	require.NoError(t, err)
	defer rows.Close()
	present := map[string]bool{}
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		present[id] = true
	}
	require.NoError(t, rows.Err())
	vanished := map[string]bool{}
	for id := range wr.committed {
		if !present[id] {
			vanished[id] = true
			delete(wr.committed, id)
		}
	}
	for id := range wr.uncertain {
		if present[id] {
			wr.committed[id] = true
		} else {
			vanished[id] = false
		}
	}
	wr.uncertain = map[string]bool{}
	return vanished
}

// settleFailover waits until every event the writer committed has an
// effect, or a consumer reported its effect committed (on the old primary,
// which the new one may lack), and returns how long that took after the
// last fault.
func (w *world) settleFailover() time.Duration {
	w.t.Helper()
	expected := w.table("expected")
	_, err := w.db.Exec(`CREATE TABLE ` + expected + ` (event_id TEXT PRIMARY KEY)`)
	require.NoError(w.t, err)
	w.writer.mu.Lock()
	ids := make([]string, 0, len(w.writer.committed))
	for id := range w.writer.committed {
		ids = append(ids, id)
	}
	w.writer.mu.Unlock()
	_, err = w.db.Exec(`INSERT INTO `+expected+` SELECT unnest($1::text[])`, ids)
	require.NoError(w.t, err)
	return w.settleWhen(settleTimeout, func() (progress, error) {
		// Up to a thousand are looked up among the reported ones.
		missing, some, err := w.missingEffects(1000)
		if err != nil {
			return progress{}, err
		}
		done := missing == len(some)
		if done && missing > 0 {
			reported := w.reportedEffects()
			for _, id := range some {
				done = done && reported[id]
			}
		}
		return progress{applied: len(ids) - missing, done: done,
			state: fmt.Sprintf("%d of %d events have an effect", len(ids)-missing, len(ids))}, nil
	})
}

// missingEffects counts the expected events without an effect and returns
// them, or none when there are more than limit.
func (w *world) missingEffects(limit int) (int, []string, error) {
	var missing int
	var some string
	err := w.db.QueryRow(`WITH missing AS (SELECT event_id FROM `+w.table("expected")+` e
			WHERE NOT EXISTS (SELECT 1 FROM `+w.table("effects")+` f WHERE f.event_id = e.event_id))
		SELECT (SELECT count(*) FROM missing),
			CASE WHEN (SELECT count(*) FROM missing) <= $1 THEN (SELECT coalesce(string_agg(event_id, ','), '') FROM missing) ELSE '' END`,
		limit).Scan(&missing, &some)
	if err != nil || some == "" {
		return missing, nil, err
	}
	return missing, strings.Split(some, ","), nil
}

// reportedEffects returns the events whose effect a consumer node reported
// committed (nodeSpec.ReportEffects).
func (w *world) reportedEffects() map[string]bool {
	reported := map[string]bool{}
	for _, n := range w.snapshot() {
		for line := range strings.SplitSeq(n.stderr.String(), "\n") {
			if id, ok := strings.CutPrefix(line, effectLine); ok {
				reported[id] = true
			}
		}
	}
	return reported
}

// effectsLostWithOldPrimary takes out of the writer's committed events
// those without an effect whose effect a consumer reported committed: it
// was committed on the old primary and lost with it. It returns how many.
// The others without an effect stay, for check to count as lost.
func (w *world) effectsLostWithOldPrimary() int {
	w.t.Helper()
	_, missing, err := w.missingEffects(len(w.writer.committed))
	require.NoError(w.t, err)
	reported := w.reportedEffects()
	w.writer.mu.Lock()
	defer w.writer.mu.Unlock()
	lost := 0
	for _, id := range missing {
		if reported[id] {
			delete(w.writer.committed, id)
			lost++
		}
	}
	return lost
}
