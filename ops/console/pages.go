package console

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/ops"
)

// funcs are the templates' helpers.
var funcs = template.FuncMap{
	"time": func(t any) string {
		switch t := t.(type) {
		case time.Time:
			if t.IsZero() {
				return "-"
			}
			return t.UTC().Format("2006-01-02 15:04:05Z")
		case *time.Time:
			if t == nil {
				return "-"
			}
			return t.UTC().Format("2006-01-02 15:04:05Z")
		}
		return fmt.Sprint(t)
	},
	"age": func(d time.Duration) string {
		if d <= 0 {
			return "-"
		}
		return d.Round(time.Millisecond).String()
	},
	"short": func(s string, n int) string {
		s, _, cut := strings.Cut(s, "\n")
		if utf8.RuneCountInString(s) > n {
			s, cut = string([]rune(s)[:n-1]), true
		}
		if cut {
			s += "…"
		}
		return s
	},
	"join": strings.Join,
	// path escapes one segment of a link's path.
	"path": url.PathEscape,
	// dict builds the argument of a sub-template from key, value pairs.
	"dict": func(kv ...any) (map[string]any, error) {
		if len(kv)%2 != 0 {
			return nil, errors.New("dict: odd number of arguments")
		}
		m := make(map[string]any, len(kv)/2)
		for i := 0; i < len(kv); i += 2 {
			k, ok := kv[i].(string)
			if !ok {
				return nil, fmt.Errorf("dict: key %v is not a string", kv[i])
			}
			m[k] = kv[i+1]
		}
		return m, nil
	},
}

// overviewData is the outbox page's.
type overviewData struct {
	Schema, OutboxTopic, Broker string
	Statuses                    []ops.OutboxStatus
	Poisoned                    int
	PoisonedMore                bool
	Groups                      int
	Quarantined                 int
	QuarantinedMore             bool
	// Waits are the transactions whose locks the outbox's relays wait for
	// (the same for every relay group's status).
	Waits []forwarder.Wait
	// Charts are the last hour's, per relay group and consumer group.
	Charts chartsData
}

// overview is the outbox status per relay group, with the DLQ and
// quarantine at a glance, and the last hour's charts.
func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	if err := errNoFilters(r); err != nil {
		c.failErr(w, r, err)
		return
	}
	cfg := c.ops.Config()
	d := overviewData{Schema: cfg.Database.Schema, OutboxTopic: cfg.Outbox.Topic, Broker: cfg.Broker.Kind}
	var err error
	if d.Statuses, err = c.ops.OutboxStatuses(r.Context()); err != nil {
		c.failErr(w, r, err)
		return
	}
	if len(d.Statuses) > 0 {
		d.Waits = d.Statuses[0].Waits
	}
	if d.Charts, err = c.charts(r.Context()); err != nil {
		c.failErr(w, r, err)
		return
	}
	poisoned, err := c.ops.DLQ().List(r.Context(), ops.Filter{Replayed: new(false)}, maxLimit)
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	d.Poisoned, d.PoisonedMore = len(poisoned.Rows), poisoned.Truncated
	groups, err := c.ops.PoisonGroups(r.Context(), ops.Filter{Replayed: new(false)})
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	d.Groups = len(groups)
	quarantined, err := c.ops.Quarantine().List(r.Context(), ops.Filter{Replayed: new(false)}, maxLimit)
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	d.Quarantined, d.QuarantinedMore = len(quarantined.Rows), quarantined.Truncated
	c.render(w, r, "overview", page{Title: "Outbox", Nav: "outbox", Data: d})
}

// listData is a list page's.
type listData struct {
	Filter    filter
	Poisoned  []ops.PoisonedMessage
	Rows      []ops.QuarantinedRow
	Truncated bool
	Group     *ops.FailureGroup // the group a fingerprint filter selects
}

func (c *Console) dlqList(w http.ResponseWriter, r *http.Request) {
	f, list, ok := listFiltered(c, w, r, dlqKeys, c.ops.DLQ().List)
	if !ok {
		return
	}
	d := listData{Filter: f, Poisoned: list.Rows, Truncated: list.Truncated}
	if f.Fingerprint != "" {
		groups, err := c.ops.PoisonGroups(r.Context(), ops.Filter{Fingerprint: f.Fingerprint})
		if err != nil {
			c.failErr(w, r, err)
			return
		}
		if len(groups) == 1 {
			d.Group = &groups[0]
		}
	}
	c.render(w, r, "dlq", page{Title: "Dead-letter queue", Nav: "dlq", Data: d})
}

// groupsData is the failure groups page's.
type groupsData struct {
	Filter filter
	Groups []ops.FailureGroup
}

func (c *Console) dlqGroups(w http.ResponseWriter, r *http.Request) {
	f, err := parseFilter(r.URL.Query(), groupKeys)
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	groups, err := c.ops.PoisonGroups(r.Context(), f.ops())
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	c.render(w, r, "groups", page{Title: "Failure groups", Nav: "groups", Data: groupsData{Filter: f, Groups: groups}})
}

// entry is one metadata entry, for a sorted table.
type entry struct{ Key, Value string }

func sortedEntries(m map[string]string) []entry {
	out := make([]entry, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, entry{k, m[k]})
	}
	return out
}

// payloadView is a payload as it is shown: indented JSON, or a hex dump.
type payloadView struct {
	Bytes int
	Kind  string // "JSON" or "binary"
	Text  string
}

func viewPayload(p []byte) payloadView {
	if len(p) > 0 && json.Valid(p) {
		var b bytes.Buffer
		if json.Indent(&b, p, "", "  ") == nil {
			return payloadView{Bytes: len(p), Kind: "JSON", Text: b.String()}
		}
	}
	return payloadView{Bytes: len(p), Kind: "binary", Text: hex.Dump(p)}
}

// detailData is a message's or row's page's.
type detailData struct {
	Poisoned   *ops.PoisonedDetail
	Quarantine *ops.QuarantinedDetail
	Metadata   []entry
	Payload    payloadView
	Envelope   payloadView
}

// errNoFilters answers a filter given to a page that takes none.
func errNoFilters(r *http.Request) error {
	if len(r.URL.Query()) > 0 {
		return badf("this page takes no filters")
	}
	return nil
}

// detailID reads the {id} of a detail page's path, which takes no filters.
func detailID(r *http.Request) (int64, error) {
	if err := errNoFilters(r); err != nil {
		return 0, err
	}
	v := r.PathValue("id")
	id, err := strconv.ParseInt(v, 10, 64)
	if err != nil || id <= 0 {
		return 0, badf("%q is not an id: want a positive whole number", v)
	}
	return id, nil
}

func (c *Console) dlqShow(w http.ResponseWriter, r *http.Request) {
	showDetail(c, w, r, c.ops.DLQ().Get, func(id int64, d *ops.PoisonedDetail) (string, page) {
		return "message", page{Title: fmt.Sprintf("Poisoned message %d", id), Nav: "dlq",
			Data: detailData{Poisoned: d, Metadata: sortedEntries(d.Metadata), Payload: viewPayload(d.Payload)}}
	})
}

func (c *Console) quarantineList(w http.ResponseWriter, r *http.Request) {
	f, list, ok := listFiltered(c, w, r, quarantineKeys, c.ops.Quarantine().List)
	if !ok {
		return
	}
	c.render(w, r, "quarantine", page{Title: "Relay quarantine", Nav: "quarantine",
		Data: listData{Filter: f, Rows: list.Rows, Truncated: list.Truncated}})
}

func (c *Console) quarantineShow(w http.ResponseWriter, r *http.Request) {
	showDetail(c, w, r, c.ops.Quarantine().Get, func(id int64, d *ops.QuarantinedDetail) (string, page) {
		return "row", page{Title: fmt.Sprintf("Quarantined row %d", id), Nav: "quarantine",
			Data: detailData{Quarantine: d, Metadata: sortedEntries(d.Metadata), Payload: viewPayload(d.Payload), Envelope: viewPayload(d.Envelope)}}
	})
}

// listFiltered reads the rows the request's filters (of keys) select; on
// an error it renders the error page and returns false.
func listFiltered[R any](c *Console, w http.ResponseWriter, r *http.Request, keys []string,
	list func(context.Context, ops.Filter, int) (ops.List[R], error)) (filter, ops.List[R], bool) {
	f, err := parseFilter(r.URL.Query(), keys)
	if err != nil {
		c.failErr(w, r, err)
		return f, ops.List[R]{}, false
	}
	rows, err := list(r.Context(), f.ops(), f.Limit)
	if err != nil {
		c.failErr(w, r, err)
		return f, rows, false
	}
	return f, rows, true
}

// showDetail renders the detail page of the row the path's id names: get
// reads the row, and view makes the template name and page of it.
func showDetail[D any](c *Console, w http.ResponseWriter, r *http.Request,
	get func(context.Context, int64) (D, error), view func(int64, *D) (string, page)) {
	id, err := detailID(r)
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	d, err := get(r.Context(), id)
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	name, p := view(id, &d)
	c.render(w, r, name, p)
}

// actionData is the page of a dry run (Confirm) or of the action done.
type actionData struct {
	What      string // "dlq" or "quarantine"
	Action    string // "replay", "purge" or "skip" (the DLQ's)
	Confirm   bool   // a dry run awaiting confirmation
	Selection selection
	Token     string
	Count     int // messages or rows acted on (or that would be)
	Skipped   int
	Messages  int // outbox messages written (or that would be)
	Released  int // parked aggregates a skip released (or would)
	Rows      []row
	Warnings  []string
}

// row is one line of an action's table.
type row struct {
	ID                    int64
	Topic, Handler, Event string
	Note                  string
}

// checkAction refuses unknown actions (serve refuses every action in
// read-only mode).
func (c *Console) checkAction(w http.ResponseWriter, r *http.Request) (string, bool) {
	action := r.PathValue("action")
	if action != "replay" && action != "purge" && action != "skip" {
		c.fail(w, r, http.StatusNotFound, fmt.Sprintf("no action %q: replay, purge or skip", action))
		return "", false
	}
	return action, true
}

// runAction is the frame of the replay and purge pages: it checks the action,
// parses the selection from the form, lets fill run it (a dry run whose page
// asks for confirmation when the form has no expect token, the action itself
// when it has) and renders the result under nav.
func (c *Console) runAction(w http.ResponseWriter, r *http.Request, what string, keys []string,
	fill func(d *actionData, dryRun bool) error) {
	action, ok := c.checkAction(w, r)
	if !ok {
		return
	}
	sel, err := parseSelection(r.PostForm, keys)
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	dryRun := sel.expect == ""
	d := actionData{What: what, Action: action, Confirm: dryRun, Selection: sel}
	if err := fill(&d, dryRun); err != nil {
		c.failErr(w, r, err)
		return
	}
	c.render(w, r, "action", page{Title: actionTitle(d), Nav: what, Data: d})
}

// dlqAction replays or purges poisoned messages.
func (c *Console) dlqAction(w http.ResponseWriter, r *http.Request) {
	tableAction(c, w, r, "dlq", dlqKeys, c.ops.DLQ(), actionRows[ops.PoisonedMessage, ops.ReplayedEntry, ops.SkippedEntry]{
		replayed: func(e ops.ReplayedEntry) row {
			note := "replay, processed only by consumer group(s) " + strings.Join(e.TargetGroups, ", ")
			if e.Parked {
				note = "its parked aggregate released: handled ahead of the messages parked behind it, no outbox message"
			}
			return row{ID: e.ID, Topic: e.Topic, Handler: e.Handler, Event: e.EventType, Note: note}
		},
		skipped: func(e ops.SkippedEntry) row {
			note := "skipped: " + e.Detail
			if e.Reason == ops.SkipAlreadyProcessed {
				note = "skipped: its group's inbox recorded the event at " + e.ProcessedAt.UTC().Format(time.RFC3339)
			}
			return row{ID: e.ID, Topic: e.Topic, Handler: e.Handler, Event: e.EventType, Note: note}
		},
		purged: func(m ops.PoisonedMessage) row {
			return row{ID: m.ID, Topic: m.Topic, Handler: m.Handler, Event: m.EventType, Note: m.State}
		},
	})
}

// quarantineAction replays or purges quarantined outbox rows.
func (c *Console) quarantineAction(w http.ResponseWriter, r *http.Request) {
	tableAction(c, w, r, "quarantine", quarantineKeys, c.ops.Quarantine(), actionRows[ops.QuarantinedRow, ops.QuarantinedRow, ops.QuarantineSkipped]{
		replayed: func(q ops.QuarantinedRow) row { return row{ID: q.ID, Topic: q.Topic, Event: q.EventID, Note: "replay"} },
		skipped: func(q ops.QuarantineSkipped) row {
			return row{ID: q.ID, Topic: q.Topic, Event: q.EventID, Note: "skipped (" + q.Skip + "): " + q.Detail}
		},
		purged: func(q ops.QuarantinedRow) row { return row{ID: q.ID, Topic: q.Topic, Event: q.EventID, Note: q.Reason} },
	})
}

// actionRows turn a table's replayed, skipped and purged entries into the
// rows of the action page.
type actionRows[R, E, S any] struct {
	replayed func(E) row
	skipped  func(S) row
	purged   func(R) row
}

// tableAction replays or purges rows of t, the DLQ or the relay quarantine.
func tableAction[R, D, E, S any](c *Console, w http.ResponseWriter, r *http.Request, what string, keys []string,
	t ops.Table[R, D, E, S], rows actionRows[R, E, S]) {
	c.runAction(w, r, what, keys, func(d *actionData, dryRun bool) error {
		if d.Action == "replay" {
			res, err := t.Replay(r.Context(), d.Selection.ops(), ops.ReplayOptions{DryRun: dryRun, By: c.by(r)})
			if err != nil {
				return err
			}
			d.Token, d.Count, d.Skipped, d.Messages, d.Warnings = res.Selection, len(res.Replayed), len(res.Skipped), res.Messages, res.Warnings
			for _, e := range res.Replayed {
				d.Rows = append(d.Rows, rows.replayed(e))
			}
			for _, e := range res.Skipped {
				d.Rows = append(d.Rows, rows.skipped(e))
			}
			return nil
		}
		if d.Action == "skip" {
			return skipAction(r.Context(), t, d, dryRun, rows.purged) // parked.go
		}
		res, err := t.Purge(r.Context(), d.Selection.ops(), dryRun)
		if err != nil {
			return err
		}
		d.Token, d.Count = res.Selection, len(res.Purged)
		for _, m := range res.Purged {
			d.Rows = append(d.Rows, rows.purged(m))
		}
		return nil
	})
}

func actionTitle(d actionData) string {
	what := map[string]string{"dlq": "poisoned messages", "quarantine": "quarantined rows"}[d.What]
	if d.Confirm {
		return fmt.Sprintf("Confirm: %s %d %s", d.Action, d.Count, what)
	}
	verb := map[string]string{"replay": "Replayed", "purge": "Purged", "skip": "Skipped"}[d.Action]
	return fmt.Sprintf("%s %d %s", verb, d.Count, what)
}

// sagasData is the saga list's.
type sagasData struct {
	Filter    sagaFilter
	Instances []ops.SagaInstance
	Truncated bool
}

func (c *Console) sagaList(w http.ResponseWriter, r *http.Request) {
	f, err := parseSagaFilter(r.URL.Query())
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	list, err := c.ops.ListSagas(r.Context(), f.ops(), f.Limit)
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	c.render(w, r, "sagas", page{Title: "Sagas", Nav: "sagas", Data: sagasData{Filter: f, Instances: list.Instances, Truncated: list.Truncated}})
}

// sagaTimeout is one pending timeout of a saga instance.
type sagaTimeout struct {
	Name, EventID string
	Event         *ops.ScheduledEvent // nil when it is no longer scheduled (due and moved to the outbox, or cancelled)
}

// sagaData is a saga instance's page's.
type sagaData struct {
	Instance ops.SagaInstance
	State    payloadView
	Timeouts []sagaTimeout
}

func (c *Console) sagaShow(w http.ResponseWriter, r *http.Request) {
	if err := errNoFilters(r); err != nil {
		c.failErr(w, r, err)
		return
	}
	inst, err := c.ops.Saga(r.Context(), r.PathValue("saga"), r.PathValue("id"))
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	d := sagaData{Instance: inst, State: viewPayload(inst.State)}
	if len(inst.Timeouts) > 0 {
		scheduled, err := c.ops.ScheduledEvents(r.Context(), slices.Collect(maps.Values(inst.Timeouts))...)
		if err != nil {
			c.failErr(w, r, err)
			return
		}
		byID := make(map[string]*ops.ScheduledEvent, len(scheduled))
		for i := range scheduled {
			byID[scheduled[i].ID] = &scheduled[i]
		}
		for _, e := range sortedEntries(inst.Timeouts) {
			d.Timeouts = append(d.Timeouts, sagaTimeout{Name: e.Key, EventID: e.Value, Event: byID[e.Value]})
		}
	}
	c.render(w, r, "saga", page{Title: fmt.Sprintf("Saga %s %s", inst.Saga, inst.ID), Nav: "sagas", Data: d})
}

// scheduledData is the scheduled events page's.
type scheduledData struct {
	Events    []ops.ScheduledEvent
	Total     int64
	Truncated bool
}

func (c *Console) scheduledList(w http.ResponseWriter, r *http.Request) {
	err := checkKeys(r.URL.Query(), scheduledKeys, nil)
	limit := defaultLimit
	if err == nil {
		limit, err = parseLimit(strings.TrimSpace(r.URL.Query().Get("limit")))
	}
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	list, err := c.ops.ListScheduled(r.Context(), limit)
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	c.render(w, r, "scheduled", page{Title: "Scheduled events", Nav: "scheduled",
		Data: scheduledData{Events: list.Events, Total: list.Total, Truncated: list.Truncated}})
}
