package main

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/millrace-io/millrace/bus"
)

// filter selects rows of the poison table; list, replay and purge share it.
type filter struct {
	topic, handler, group, reason string
	fingerprint                   string
	since, until                  timeFlag
	replayed, notReplayed         bool
	limit                         int
}

func (f *filter) register(fs *flag.FlagSet, limit int, limitUsage string) {
	fs.StringVar(&f.topic, "topic", "", "only messages of this source `topic`")
	fs.StringVar(&f.handler, "handler", "", "only messages of this `handler`")
	fs.StringVar(&f.group, "group", "", "only messages of this consumer `group`")
	fs.StringVar(&f.reason, "reason", "", "only messages whose failure reason contains `text` (case-insensitive)")
	fs.StringVar(&f.fingerprint, "fingerprint", "", "only messages of the failure group `FP` (12 hex digits, as `millrace dlq groups` shows)")
	fs.Var(&f.since, "since", "only messages poisoned at or after `TIME`: RFC 3339 (2025-05-01T12:00:00Z) or a duration ago (90m, 2h, 7d)")
	fs.Var(&f.until, "until", "only messages poisoned before `TIME`: RFC 3339 or a duration ago")
	fs.BoolVar(&f.replayed, "replayed", false, "only messages replayed since they were last poisoned")
	fs.BoolVar(&f.notReplayed, "not-replayed", false, "only messages not replayed since they were last poisoned")
	if limitUsage != "" { // "": a command without --limit
		fs.IntVar(&f.limit, "limit", limit, limitUsage)
	}
}

// registerQuarantine registers the flags that apply to the relay
// quarantine, which has no handlers or consumer groups.
func (f *filter) registerQuarantine(fs *flag.FlagSet, limit int, limitUsage string) {
	fs.StringVar(&f.topic, "topic", "", "only rows for this destination `topic`")
	fs.StringVar(&f.reason, "reason", "", "only rows whose reason contains `text` (case-insensitive)")
	fs.Var(&f.since, "since", "only rows quarantined at or after `TIME`: RFC 3339 (2025-05-01T12:00:00Z) or a duration ago (90m, 2h, 7d)")
	fs.Var(&f.until, "until", "only rows quarantined before `TIME`: RFC 3339 or a duration ago")
	fs.BoolVar(&f.replayed, "replayed", false, "only rows replayed")
	fs.BoolVar(&f.notReplayed, "not-replayed", false, "only rows not replayed")
	fs.IntVar(&f.limit, "limit", limit, limitUsage)
}

// check reports contradictory or invalid filter flags.
func (f *filter) check() error {
	if f.replayed && f.notReplayed {
		return usagef("--replayed and --not-replayed exclude each other; give one or neither")
	}
	if err := checkLimit(f.limit); err != nil {
		return err
	}
	if f.fingerprint != "" && !isFingerprint(f.fingerprint) {
		return usagef("--fingerprint %q: want 12 lowercase hex digits, as `millrace dlq groups` shows", f.fingerprint)
	}
	return nil
}

func isFingerprint(s string) bool {
	if len(s) != 12 {
		return false
	}
	for _, r := range s {
		if (r < '0' || r > '9') && (r < 'a' || r > 'f') {
			return false
		}
	}
	return true
}

// selects reports whether any criterion (not --limit) is set.
func (f *filter) selects() bool {
	return f.topic != "" || f.handler != "" || f.group != "" || f.reason != "" || f.fingerprint != "" ||
		f.since.set || f.until.set || f.replayed || f.notReplayed
}

// poisonFilter is the filter as the operations API takes it.
func (f *filter) poisonFilter() bus.PoisonFilter {
	pf := bus.PoisonFilter{Topic: f.topic, Handler: f.handler, Group: f.group, Reason: f.reason,
		Fingerprint: f.fingerprint, Since: f.since.bound(), Until: f.until.bound()}
	switch {
	case f.replayed:
		pf.Replayed = new(true)
	case f.notReplayed:
		pf.Replayed = new(false)
	}
	return pf
}

// quarantineFilter is the filter for the relay quarantine, which has no
// handlers or consumer groups.
func (f *filter) quarantineFilter() bus.QuarantineFilter {
	qf := bus.QuarantineFilter{Topic: f.topic, Reason: f.reason, Since: f.since.bound(), Until: f.until.bound()}
	switch {
	case f.replayed:
		qf.Replayed = new(true)
	case f.notReplayed:
		qf.Replayed = new(false)
	}
	return qf
}

// selection is what replay and purge act on: IDs, a filter, or --all.
type selection struct {
	filter
	all bool
	ids []int64
	// quarantine selects rows of the relay quarantine instead of the poison table.
	quarantine bool
}

func (s *selection) register(fs *flag.FlagSet) {
	s.filter.register(fs, 0, "act on at most `N` matching messages, oldest first (0: no limit)")
	fs.BoolVar(&s.all, "all", false, "select every message of the poison table (instead of IDs or filters)")
}

func (s *selection) registerQuarantine(fs *flag.FlagSet) {
	s.quarantine = true
	s.filter.registerQuarantine(fs, 0, "act on at most `N` matching rows, oldest first (0: no limit)")
	fs.BoolVar(&s.all, "all", false, "select every row of the relay quarantine (instead of IDs or filters)")
}

// resolve reads the IDs among args and checks that exactly one kind of
// selection was given.
func (s *selection) resolve(args []string, verb string) error {
	if err := s.check(); err != nil {
		return err
	}
	for _, a := range args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id <= 0 {
			if s.quarantine {
				return usagef("%q is not a quarantined row ID (a positive integer, as `millrace quarantine list` shows)", a)
			}
			return usagef("%q is not a poison message ID (a positive integer, as `millrace dlq list` shows)", a)
		}
		s.ids = append(s.ids, id)
	}
	kinds := 0
	for _, given := range []bool{len(s.ids) > 0, s.selects(), s.all} {
		if given {
			kinds++
		}
	}
	switch {
	case kinds == 0 && s.quarantine:
		return usagef("choose what to %s: row IDs, filters (--topic, --reason, --since, --until, --replayed, --not-replayed) or --all", verb)
	case kinds == 0:
		return usagef("choose what to %s: message IDs, filters (--topic, --handler, --group, --reason, --fingerprint, --since, --until, --replayed, --not-replayed) or --all", verb)
	case kinds > 1:
		return usagef("give message IDs, filters or --all, not several of them")
	case len(s.ids) > 0 && s.limit > 0:
		return usagef("--limit applies to filters and --all, not to message IDs")
	}
	return nil
}

// poisonSelection is the selection as the operations API takes it.
func (s *selection) poisonSelection() bus.PoisonSelection {
	return bus.PoisonSelection{IDs: s.ids, Filter: s.poisonFilter(), All: s.all, Limit: s.limit}
}

// quarantineSelection is the selection of relay quarantine rows.
func (s *selection) quarantineSelection() bus.QuarantineSelection {
	return bus.QuarantineSelection{IDs: s.ids, Filter: s.quarantineFilter(), All: s.all, Limit: s.limit}
}

// timeFlag is an RFC 3339 time or a duration meaning "that long ago",
// measured on the database's clock.
type timeFlag struct {
	set bool
	at  time.Time
	ago time.Duration
}

func (t *timeFlag) String() string {
	switch {
	case !t.set:
		return ""
	case !t.at.IsZero():
		return t.at.Format(time.RFC3339Nano)
	default:
		return t.ago.String()
	}
}

func (t *timeFlag) Set(v string) error {
	if at, err := time.Parse(time.RFC3339Nano, v); err == nil {
		*t = timeFlag{set: true, at: at}
		return nil
	}
	d, err := parseAge(v)
	if err != nil {
		return fmt.Errorf("want an RFC 3339 time such as 2025-05-01T12:00:00Z or a duration ago such as 90m, 2h or 7d; got %q", v)
	}
	*t = timeFlag{set: true, ago: d}
	return nil
}

// bound is the flag as a filter bound; unset flags leave it open.
func (t *timeFlag) bound() bus.TimeBound {
	switch {
	case !t.set:
		return bus.TimeBound{}
	case !t.at.IsZero():
		return bus.At(t.at)
	default:
		return bus.Ago(t.ago)
	}
}

// parseAge parses a non-negative Go duration ("90m", "1h30m") or a whole
// number of days ("7d"), which Go durations lack.
func parseAge(v string) (time.Duration, error) {
	if days, ok := strings.CutSuffix(v, "d"); ok {
		n, err := strconv.ParseUint(days, 10, 16)
		if err != nil {
			return 0, fmt.Errorf("not a number of days: %q", v)
		}
		return time.Duration(n) * 24 * time.Hour, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, err
	}
	if d < 0 {
		return 0, fmt.Errorf("negative duration %q", v)
	}
	return d, nil
}

// durationFlag is a positive duration that also accepts days ("7d").
type durationFlag struct{ d time.Duration }

func (f *durationFlag) String() string {
	if f.d == 0 {
		return ""
	}
	return f.d.String()
}

func (f *durationFlag) Set(v string) error {
	d, err := parseAge(v)
	if err != nil || d == 0 {
		return fmt.Errorf("want a positive duration such as 90m, 720h or 30d; got %q", v)
	}
	f.d = d
	return nil
}
