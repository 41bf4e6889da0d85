package faults

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/stretchr/testify/require"
)

// latency is how long the events committed in a window took from the
// service's COMMIT to their effect.
type latency struct {
	events        int // events measured: committed in the window, with an effect
	p50, p99, max time.Duration
}

// String says p50, p99 and max, or that nothing was measured.
func (l latency) String() string {
	if l.events == 0 {
		return "n/a (not committed at a rate)"
	}
	return fmt.Sprintf("p50 %s, p99 %s, max %s", roughly(l.p50), roughly(l.p99), roughly(l.max))
}

// roughly rounds d to a millisecond below a second, to 100ms above.
func roughly(d time.Duration) time.Duration {
	if d < time.Second {
		return d.Round(time.Millisecond)
	}
	return d.Round(100 * time.Millisecond)
}

// latency measures the events the writer committed at a rate whose COMMIT
// was sent between from and to: the time from then until their first
// effect row was inserted (by the database's clock, on this machine). Events
// without an effect are left out (check counts them as lost).
func (w *world) latency(from, to time.Time) latency {
	w.t.Helper()
	applied := w.effectTimes()
	w.writer.mu.Lock()
	var delays []time.Duration
	for id, at := range w.writer.pacedAt {
		if effect, ok := applied[id]; ok && !at.Before(from) && !at.After(to) {
			delays = append(delays, effect.Sub(at))
		}
	}
	w.writer.mu.Unlock()
	if len(delays) == 0 {
		return latency{}
	}
	slices.Sort(delays)
	at := func(q float64) time.Duration { return delays[int(math.Ceil(q*float64(len(delays))))-1] }
	return latency{events: len(delays), p50: at(0.5), p99: at(0.99), max: delays[len(delays)-1]}
}

// effectTimes returns when each event's first effect row was inserted.
func (w *world) effectTimes() map[string]time.Time {
	w.t.Helper()
	rows, err := w.db.Query(`SELECT event_id, min(applied_at) FROM ` + w.table("effects") + ` GROUP BY event_id`)
	require.NoError(w.t, err)
	defer rows.Close()
	applied := map[string]time.Time{}
	for rows.Next() {
		var id string
		var at time.Time
		require.NoError(w.t, rows.Scan(&id, &at))
		applied[id] = at
	}
	require.NoError(w.t, rows.Err())
	return applied
}
