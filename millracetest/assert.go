package millracetest

import (
	"context"
	"database/sql"
	"fmt"
	"strings"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/middleware"
)

// CountFunc counts the business effects of one event in the test database,
// e.g. SELECT count(*) FROM invoices WHERE event_id = $1. tx is a read-only
// snapshot; ev is the event as the handler received it.
type CountFunc func(ctx context.Context, tx *sql.Tx, ev bus.Event) (int, error)

// Effects returns count's result for ev, one of the events the harness
// delivered. It fails the test if count fails.
func (h *Harness) Effects(count CountFunc, ev bus.Event) int {
	h.t.Helper()
	counts, ok := h.count(count, []bus.Event{ev})
	if !ok {
		return 0
	}
	return counts[0]
}

// AssertOnce checks that each of evs (every event delivered so far when
// none is given) has exactly one effect by count, and reports each one that
// has not with its deliveries and what they mean (effects written outside
// bus.Tx, the inbox off, a poisoned or stale event). It returns whether
// all passed.
func (h *Harness) AssertOnce(count CountFunc, evs ...bus.Event) bool {
	h.t.Helper()
	if len(evs) == 0 {
		evs = h.deliveredEvents()
		if len(evs) == 0 {
			h.t.Errorf("millracetest: AssertOnce: no event was delivered")
			return false
		}
	}
	counts, ok := h.count(count, evs)
	if !ok {
		return false
	}
	for i, ev := range evs {
		if counts[i] != 1 {
			h.t.Errorf("%s", h.explain(ev, counts[i]))
			ok = false
		}
	}
	return ok
}

// Outcomes returns the outcome of each delivery of ev, in order.
func (h *Harness) Outcomes(ev bus.Event) []string {
	var out []string
	for _, d := range h.deliveriesOf(ev.ID) {
		out = append(out, d.Outcome)
	}
	return out
}

// HandlerRuns returns how many times the handler ran for ev, over all its
// deliveries, retries included.
func (h *Harness) HandlerRuns(ev bus.Event) int {
	n := 0
	for _, d := range h.deliveriesOf(ev.ID) {
		n += d.HandlerRuns
	}
	return n
}

// deliveredEvents returns every event delivered so far, in the order of
// their first delivery.
func (h *Harness) deliveredEvents() []bus.Event {
	seen := map[string]bool{}
	var out []bus.Event
	for _, d := range h.Deliveries() {
		if !seen[d.EventID] {
			seen[d.EventID] = true
			out = append(out, h.eventByID(d.EventID))
		}
	}
	return out
}

// eventByID returns the delivered event with id.
func (h *Harness) eventByID(id string) bus.Event {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.delivered[id]
}

// count runs count for each event in one read-only snapshot.
func (h *Harness) count(count CountFunc, evs []bus.Event) ([]int, bool) {
	h.t.Helper()
	if count == nil {
		h.t.Fatalf("millracetest: the CountFunc is nil")
		return nil, false
	}
	full := make([]bus.Event, len(evs))
	for i, ev := range evs {
		if ev.ID == "" {
			h.t.Fatalf("millracetest: event %d (%s) has no ID: pass the events the harness returned, which carry the ids it delivered", i, ev.Type)
			return nil, false
		}
		if full[i] = h.eventByID(ev.ID); full[i].ID == "" {
			h.t.Fatalf("millracetest: event %s was never delivered by this harness", ev.ID)
			return nil, false
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	tx, err := h.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		h.t.Fatalf("millracetest: begin the counting transaction: %v", err)
		return nil, false
	}
	defer tx.Rollback() //nolint:errcheck // read only
	counts := make([]int, len(full))
	for i, ev := range full {
		if counts[i], err = count(ctx, tx, ev); err != nil {
			h.t.Fatalf("millracetest: CountFunc for event %s: %v", ev.ID, err)
			return nil, false
		}
	}
	return counts, true
}

// explain describes why ev has effects effects rather than one.
func (h *Harness) explain(ev bus.Event, effects int) string {
	ev = h.eventByID(ev.ID)
	cfg := h.cfg.Consumer.For(h.name)
	var runs, commits int
	outcomes := map[string]int{}
	for _, d := range h.deliveriesOf(ev.ID) {
		runs += d.HandlerRuns
		outcomes[d.Outcome]++
		if d.Outcome == middleware.OutcomeOK && d.HandlerRuns > 0 {
			commits++
		}
	}
	inTx := *cfg.Inbox.Enabled || *cfg.OrderingGuard

	var b strings.Builder
	fmt.Fprintf(&b, "millracetest: event %s (%s of %s %s): %d %s, want exactly 1\n",
		ev.ID, ev.Type, ev.AggregateType, ev.AggregateID, effects, plural(effects, "effect", "effects"))
	b.WriteString(h.historyText(ev.ID))
	var why string
	switch {
	case effects > 1 && !*cfg.Inbox.Enabled:
		why = fmt.Sprintf("consumer.inbox.enabled is false for handler %s: nothing deduplicates, so every delivery that reaches the handler runs it (%d %s).",
			h.name, runs, plural(runs, "run", "runs"))
	case effects > 1 && inTx && runs > commits:
		rolledBack := runs - commits
		why = fmt.Sprintf("The handler ran %d times: %d %s committed, %d %s rolled back, undoing what %s wrote in bus.Tx. "+
			"Yet %d effects remain, so the handler has effects outside bus.Tx (a write on its own connection or pool, a call to another service, a message sent directly) that no rollback undoes. "+
			"Write them in bus.Tx, publish follow-ups with bus.Publish(ctx, bus.Tx[bus.Execer](ctx), ...), or make the outside effect idempotent, keyed by the event id.",
			runs, commits, plural(commits, "run", "runs"), rolledBack, plural(rolledBack, "was", "were"), plural(rolledBack, "it", "they"), effects)
	case effects > 1 && runs <= 1:
		why = fmt.Sprintf("The handler ran %d %s and made %d effects: does the CountFunc count the effects of this event only?", runs, plural(runs, "time", "times"), effects)
	case effects > 1:
		why = fmt.Sprintf("%d of the handler's transactions committed for this one event.", commits)
	case outcomes[middleware.OutcomePoisoned] > 0:
		why = "It was poisoned: " + h.poisonReason(ev.ID)
	case outcomes[middleware.OutcomeStale] > 0 && commits == 0:
		why = fmt.Sprintf("The ordering guard dropped it as stale: version %d of %s %s is not newer than the version consumer group %s had already applied.",
			ev.AggregateVersion, ev.AggregateType, ev.AggregateID, h.group)
	case commits > 0 || (!inTx && outcomes[middleware.OutcomeOK] > 0):
		why = "The handler ran and the chain acked it, but the CountFunc finds no effect: does the handler write what the CountFunc counts, in bus.Tx?"
	case runs == 0 && outcomes[middleware.OutcomeDuplicate] > 0:
		why = fmt.Sprintf("Every delivery was a duplicate: the inbox already held event %s for consumer group %s before this harness delivered it (another test on the same group?).", ev.ID, h.group)
	default:
		why = "No delivery of it completed."
	}
	b.WriteString("    " + why)
	return b.String()
}

// poisonReason returns the failure reason stored for a poisoned event.
func (h *Harness) poisonReason(eventID string) string {
	if h.poisonTopic != nil {
		if reason, ok := h.poisonTopic.reason(eventID); ok {
			return reason
		}
		return "(its reason was not recorded)"
	}
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	tables := store.Tables{Schema: h.cfg.Database.Schema}
	reason, found, err := tables.LastPoisonReason(ctx, h.db, h.group, h.name, eventID)
	switch {
	case err != nil:
		return "(" + err.Error() + ")"
	case !found:
		return "(no row in " + tables.PoisonTable() + ")"
	}
	return reason
}
