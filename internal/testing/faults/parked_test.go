package faults

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/ops"
)

// The parked-aggregate scenarios, after the others in docs/RELIABILITY.md.
const (
	parkedReplayed = "ordered: a poisoned event parks its aggregate, consumers SIGKILLed, the event replayed"
	parkedSkipped  = "ordered: a poisoned event parks its aggregate, consumers SIGKILLed, the event skipped"
)

func init() { scenarioOrder = append(scenarioOrder, parkedReplayed, parkedSkipped) }

// poisonedN is the payload n of the event a bug refuses: the 103rd event,
// version 6 of agg-2, with 14 more of agg-2 behind it among 400.
const poisonedN = 103

// TestParkedAggregateReplayed: an ordered stream over 20 aggregates, one
// event poisoned (a bug refuses it), consumers SIGKILLed twice meanwhile;
// the poisoned event's aggregate is parked while the others flow. The bug
// is fixed and the event replayed; the consumer draining the park is
// SIGKILLed after 3 effects and another takes the park over. Every event
// has one effect, in version order per aggregate, the replayed one before
// those parked behind it.
func TestParkedAggregateReplayed(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) { parkedAggregate(t, kind, false) })
}

// TestParkedAggregateSkipped is TestParkedAggregateReplayed with the
// poisoned event skipped: it has no effect, and the events parked behind
// it have theirs, in order.
func TestParkedAggregateSkipped(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) { parkedAggregate(t, kind, true) })
}

func parkedAggregate(t *testing.T, kind string, skip bool) {
	w := newWorld(t, kind, worldOptions{})
	ctx := context.Background()
	_, err := w.db.Exec(`CREATE TABLE ` + w.table("fixed") + ` (at TIMESTAMPTZ NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	consumer := nodeSpec{Consume: true, RefuseUntilFixed: poisonedN}
	w.writer.commit(400)
	w.start("relay", nodeSpec{Relay: true})
	w.killInTurn("consumer", 2, consumer, 30, 70)
	live := w.start("consumer", consumer)
	p := w.awaitParked()
	live.kill()
	w.fault()

	oc, err := ops.New(ctx, w.db, w.cfg)
	require.NoError(t, err)
	_, err = w.db.Exec(`INSERT INTO ` + w.table("fixed") + ` DEFAULT VALUES`)
	require.NoError(t, err)
	released := time.Now()
	if skip {
		res, err := oc.DLQ().Skip(ctx, ops.Selection{IDs: []int64{p.PoisonID}}, false)
		require.NoError(t, err)
		require.Equal(t, 1, res.Released)
		w.writer.mu.Lock()
		delete(w.writer.committed, p.eventID)
		w.writer.rolledBack[p.eventID] = true // skipped: an effect would be a ghost
		w.writer.mu.Unlock()
	} else {
		res, err := oc.DLQ().Replay(ctx, ops.Selection{IDs: []int64{p.PoisonID}}, ops.ReplayOptions{By: "faults"})
		require.NoError(t, err)
		require.Len(t, res.Replayed, 1)
		require.True(t, res.Replayed[0].Parked, "the replay releases the park")
		require.Zero(t, res.Messages, "no broker round trip")
	}
	w.killInTurn("drainer", 1, consumer, 3, 0) // SIGKILLed mid-drain
	w.start("consumer", consumer)
	recovery := w.settle(settleTimeout)
	drained := time.Since(released)

	state := map[bool]string{false: ops.PoisonStateProcessed, true: ops.PoisonStateSkipped}[skip]
	m, err := oc.DLQ().Get(ctx, p.PoisonID)
	require.NoError(t, err)
	require.Equal(t, state, m.State)
	left, err := oc.Parked(ctx, ops.ParkedFilter{}, 0)
	require.NoError(t, err)
	require.Empty(t, left.Rows, "the park is gone once drained")
	// The operator purges the handled row: nothing else may be in the DLQ.
	_, err = oc.DLQ().Purge(ctx, ops.Selection{IDs: []int64{p.PoisonID}}, false)
	require.NoError(t, err)

	scenario, verb := parkedReplayed, "replayed: it and the parked events drained"
	if skip {
		scenario, verb = parkedSkipped, "skipped: the parked events drained without it"
	}
	w.record(result{scenario: scenario, broker: kind, o: w.check(true), ordered: true, recovery: recovery,
		faults: "3 SIGKILLs: 2 before the release, 1 of the consumer draining the park, after 3 effects",
		note: fmt.Sprintf("%s's version %d poisoned, its %d later events parked while 19 aggregates flowed; %s in %s (a park's lease outlives a killed holder by up to 5 s)",
			p.Key, p.version, p.later, verb, drained.Round(100*time.Millisecond))})
}

// parked is the park the scenario awaits.
type parked struct {
	ops.ParkedAggregate
	eventID string
	version int
	later   int // the aggregate's events after the poisoned one
}

// awaitParked waits until the poisoned event's aggregate is parked with
// every later event of it behind the poisoned one, and every other event
// has its effect.
func (w *world) awaitParked() parked {
	t := w.t
	t.Helper()
	var p parked
	deadline := time.Now().Add(2 * time.Minute)
	state := "no poisoned event yet"
	for {
		var aggregate string
		err := w.db.QueryRow(`SELECT event_id, metadata->>'aggregate-id', (metadata->>'aggregate-version')::int FROM `+
			w.table("millrace_poison")).Scan(&p.eventID, &aggregate, &p.version)
		if err == nil {
			w.writer.mu.Lock()
			p.later = w.writer.version[aggregate] - p.version
			committed := len(w.writer.committed)
			w.writer.mu.Unlock()
			// Held: the parked messages without an effect (message id =
			// event id here). A redelivery of an earlier event of the
			// aggregate whose ack a kill lost is parked too, and has one.
			var effects, held int
			require.NoError(t, w.db.QueryRow(`SELECT (SELECT count(DISTINCT event_id) FROM `+w.table("effects")+`),
				(SELECT count(DISTINCT message_id) FROM `+w.table("millrace_parked")+` WHERE message_id NOT IN (SELECT event_id FROM `+
				w.table("effects")+`))`).Scan(&effects, &held))
			state = fmt.Sprintf("%s version %d poisoned; %d of %d other events have an effect, %d of %d without one parked", aggregate, p.version,
				effects, committed-p.later-1, held, p.later+1)
			if effects == committed-p.later-1 && held == p.later+1 {
				oc, err := ops.New(context.Background(), w.db, w.cfg)
				require.NoError(t, err)
				l, err := oc.Parked(context.Background(), ops.ParkedFilter{Key: aggregate}, 0)
				require.NoError(t, err)
				require.Len(t, l.Rows, 1)
				require.Equal(t, ops.ParkStateHeld, l.Rows[0].State)
				p.ParkedAggregate = l.Rows[0]
				return p
			}
		}
		w.nodesAlive()
		if time.Now().After(deadline) {
			t.Fatalf("the aggregate of event n=%s was not parked with every later event behind it after 2m: %s (%v); outbox: %s\n%s",
				strconv.Itoa(poisonedN), state, err, w.outboxState(), w.diagnose())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
