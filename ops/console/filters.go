package console

import (
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/millrace-io/millrace/ops"
)

// Filter keys each list accepts; any other key is a 400 naming it.
var (
	dlqKeys        = []string{"topic", "handler", "group", "reason", "since", "until", "state", "fingerprint", "limit"}
	groupKeys      = []string{"topic", "handler", "group", "reason", "since", "until", "state"}
	quarantineKeys = []string{"topic", "reason", "since", "until", "state", "limit"}
	sagaKeys       = []string{"saga", "state", "limit"}
	scheduledKeys  = []string{"limit"}
	// actionKeys are a form's keys besides its filter's.
	actionKeys = []string{"csrf", "id", "scope", "expect"}
)

// States a list can be filtered by.
const (
	stateAll      = ""
	stateWaiting  = "waiting"
	stateReplayed = "replayed"
)

// defaultLimit and maxLimit bound a list page.
const (
	defaultLimit = 100
	maxLimit     = 1000
)

// filter is a list filter as the query string (or a form) gives it,
// checked.
type filter struct {
	Topic, Handler, Group, Reason, Fingerprint string
	Since, Until                               string // as given, for links and forms
	State                                      string
	Limit                                      int
	since, until                               ops.TimeBound
}

// badInput is a request the console refuses with 400 and this reason.
type badInput struct{ reason string }

func (e badInput) Error() string { return e.reason }

func badf(format string, args ...any) error { return badInput{fmt.Sprintf(format, args...)} }

// parseFilter reads values, allowing the keys allowed and extra (a form's
// own fields), and refusing anything else, repeated keys and malformed
// values.
func parseFilter(values url.Values, allowed []string, extra ...string) (filter, error) {
	f := filter{Limit: defaultLimit}
	if err := checkKeys(values, allowed, extra); err != nil {
		return f, err
	}
	get := func(k string) string { return strings.TrimSpace(values.Get(k)) }
	f.Topic, f.Handler, f.Group, f.Reason = get("topic"), get("handler"), get("group"), get("reason")
	f.Fingerprint, f.State, f.Since, f.Until = get("fingerprint"), get("state"), get("since"), get("until")
	var err error
	if f.since, err = parseTime("since", f.Since); err != nil {
		return f, err
	}
	if f.until, err = parseTime("until", f.Until); err != nil {
		return f, err
	}
	switch f.State {
	case stateAll, stateWaiting, stateReplayed:
	default:
		return f, badf("state %q: want %q, %q or nothing (all)", f.State, stateWaiting, stateReplayed)
	}
	if f.Limit, err = parseLimit(get("limit")); err != nil {
		return f, err
	}
	if f.Fingerprint != "" && !isHex(f.Fingerprint, 12) {
		return f, badf("fingerprint %q: want 12 lowercase hex digits, as the failure groups page shows", f.Fingerprint)
	}
	return f, nil
}

// checkKeys refuses keys neither allowed nor extra, and repeated keys.
func checkKeys(values url.Values, allowed, extra []string) error {
	for key, vs := range values {
		switch {
		case slices.Contains(extra, key):
			continue
		case !slices.Contains(allowed, key):
			return badf("unknown filter %q; this page knows %s", key, strings.Join(allowed, ", "))
		case len(vs) > 1:
			return badf("filter %q is given %d times; give it once", key, len(vs))
		}
	}
	return nil
}

// parseLimit reads a page's limit; "" is defaultLimit.
func parseLimit(v string) (int, error) {
	if v == "" {
		return defaultLimit, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > maxLimit {
		return 0, badf("limit %q: want a whole number from 1 to %d", v, maxLimit)
	}
	return n, nil
}

// sagaFilter is the saga list's filter, checked.
type sagaFilter struct {
	Saga  string // a saga type's name; "" for every type
	State string // sagaRunning ("") or sagaAll
	Limit int
}

// Saga list states: running instances only (the default), or completed ones
// too (kept for their retention).
const (
	sagaRunning = ""
	sagaAll     = "all"
)

// parseSagaFilter reads the saga list's query.
func parseSagaFilter(values url.Values) (sagaFilter, error) {
	f := sagaFilter{Limit: defaultLimit}
	if err := checkKeys(values, sagaKeys, nil); err != nil {
		return f, err
	}
	f.Saga, f.State = strings.TrimSpace(values.Get("saga")), strings.TrimSpace(values.Get("state"))
	if f.State != sagaRunning && f.State != sagaAll {
		return f, badf("state %q: want %q (completed ones too) or nothing (running only)", f.State, sagaAll)
	}
	var err error
	f.Limit, err = parseLimit(strings.TrimSpace(values.Get("limit")))
	return f, err
}

func (f sagaFilter) ops() ops.SagaFilter {
	return ops.SagaFilter{Saga: f.Saga, Completed: f.State == sagaAll}
}

func isHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for _, r := range s {
		if (r < '0' || r > '9') && (r < 'a' || r > 'f') {
			return false
		}
	}
	return true
}

// parseTime reads a time bound: RFC 3339, or a duration ago ("90m", "7d").
func parseTime(key, v string) (ops.TimeBound, error) {
	if v == "" {
		return ops.TimeBound{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return ops.At(t), nil
	}
	d, err := parseAge(v)
	if err != nil {
		return ops.TimeBound{}, badf("%s %q: want an RFC 3339 time such as 2025-05-01T12:00:00Z or a duration ago such as 90m, 2h or 7d", key, v)
	}
	return ops.Ago(d), nil
}

// parseAge parses a non-negative Go duration or a whole number of days.
func parseAge(v string) (time.Duration, error) {
	if days, ok := strings.CutSuffix(v, "d"); ok {
		n, err := strconv.ParseUint(days, 10, 16)
		if err != nil {
			return 0, err
		}
		return time.Duration(n) * 24 * time.Hour, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("not a duration: %q", v)
	}
	return d, nil
}

func (f filter) replayed() *bool {
	switch f.State {
	case stateWaiting:
		return new(false)
	case stateReplayed:
		return new(true)
	}
	return nil
}

// ops is the filter as the operations API takes it; a filter of the relay
// quarantine's page has no handler, group or fingerprint (quarantineKeys).
func (f filter) ops() ops.Filter {
	return ops.Filter{Topic: f.Topic, Handler: f.Handler, Group: f.Group, Reason: f.Reason,
		Since: f.since, Until: f.until, Replayed: f.replayed(), Fingerprint: f.Fingerprint}
}

// IsSet reports whether any criterion (not the limit) is given.
func (f filter) IsSet() bool {
	return f.Topic != "" || f.Handler != "" || f.Group != "" || f.Reason != "" || f.Fingerprint != "" ||
		f.Since != "" || f.Until != "" || f.State != ""
}

// Values are the criteria as query values, for links and hidden form
// fields (the limit left out).
func (f filter) Values() url.Values {
	v := url.Values{}
	for k, s := range map[string]string{"topic": f.Topic, "handler": f.Handler, "group": f.Group, "reason": f.Reason,
		"fingerprint": f.Fingerprint, "since": f.Since, "until": f.Until, "state": f.State} {
		if s != "" {
			v.Set(k, s)
		}
	}
	return v
}

// Query is Values encoded.
func (f filter) Query() string { return f.Values().Encode() }

// selection is what an action form selects: ids, or everything its filter
// matches (scope=filter), and the token of the dry run it confirms.
type selection struct {
	ids    []int64
	filter filter
	expect string
}

// parseSelection reads an action's form: ids (id=...), or scope=filter
// with the filter's keys; expect (a dry run's token) confirms.
func parseSelection(form url.Values, filterKeys []string) (selection, error) {
	f, err := parseFilter(form, filterKeys, actionKeys...)
	if err != nil {
		return selection{}, err
	}
	s := selection{filter: f, expect: strings.TrimSpace(form.Get("expect"))}
	if s.expect != "" && !isHex(s.expect, 16) {
		return s, badf("expect %q: not a selection token", s.expect)
	}
	for _, v := range form["id"] {
		id, err := strconv.ParseInt(v, 10, 64)
		if err != nil || id <= 0 {
			return s, badf("id %q: want a positive whole number", v)
		}
		s.ids = append(s.ids, id)
	}
	scope := form.Get("scope")
	switch {
	case scope != "" && scope != "filter":
		return s, badf("scope %q: want \"filter\" or nothing", scope)
	case scope == "filter" && len(s.ids) > 0:
		return s, badf("give ids or scope=filter, not both")
	case scope == "filter" && !f.IsSet():
		return s, badf("scope=filter needs at least one criterion; to act on everything, filter by state")
	case scope == "" && f.IsSet():
		return s, badf("filters apply with scope=filter only")
	case scope == "" && len(s.ids) == 0:
		return s, badf("nothing selected: tick rows, or act on a filter or a group")
	}
	return s, nil
}

// ops is the selection as the operations API takes it.
func (s selection) ops() ops.Selection {
	if len(s.ids) > 0 {
		return ops.Selection{IDs: s.ids, Expect: s.expect}
	}
	return ops.Selection{Filter: s.filter.ops(), Expect: s.expect}
}

// Fields are the selection as hidden form fields, for the confirmation.
func (s selection) Fields() []field {
	var out []field
	for _, id := range s.ids {
		out = append(out, field{"id", strconv.FormatInt(id, 10)})
	}
	if len(s.ids) == 0 {
		out = append(out, field{"scope", "filter"})
		values := s.filter.Values()
		keys := make([]string, 0, len(values))
		for k := range values {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			out = append(out, field{k, values.Get(k)})
		}
	}
	return out
}

// field is one hidden form field.
type field struct{ Name, Value string }
