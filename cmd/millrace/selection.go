package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/millrace-io/millrace/ops"
)

// tableFlags are the words a table's filter flags and selection errors use.
type tableFlags struct {
	// rows names the rows: "messages", "rows".
	rows string
	// idNoun names one row in errors: "poison message"; listCommand lists
	// their ids: "millrace dlq list".
	idNoun, listCommand string
	// idKind is what an id argument is in the selection errors: "message", "row".
	idKind string
	// topic and reason are the usages of --topic and --reason.
	topic, reason string
	// at is what the time of a row is: "poisoned", "quarantined".
	at string
	// replayed is what --replayed adds to "only messages replayed".
	replayed string
	// all is the usage of --all.
	all string
	// dlq registers --handler, --group and --fingerprint: the poison
	// table has handlers, consumer groups and failure groups.
	dlq bool
}

// filter selects rows of the poison table or the relay quarantine; list,
// replay and purge share it.
type filter struct {
	tableFlags
	topic, handler, group, reason string
	fingerprint                   string
	since, until                  timeFlag
	replayed, notReplayed         bool
	limit                         int
}

// register registers the filter flags, and --limit with limitUsage unless
// it is "" (a command without --limit).
func (f *filter) register(fs *flag.FlagSet, limit int, limitUsage string) {
	t := f.tableFlags
	fs.StringVar(&f.topic, "topic", "", t.topic)
	if t.dlq {
		fs.StringVar(&f.handler, "handler", "", "only messages of this `handler`")
		fs.StringVar(&f.group, "group", "", "only messages of this consumer `group`")
		fs.StringVar(&f.fingerprint, "fingerprint", "", "only messages of the failure group `FP` (12 hex digits, as `millrace dlq groups` shows)")
	}
	fs.StringVar(&f.reason, "reason", "", t.reason)
	fs.Var(&f.since, "since", fmt.Sprintf("only %s %s at or after `TIME`: RFC 3339 (2025-05-01T12:00:00Z) or a duration ago (90m, 2h, 7d)", t.rows, t.at))
	fs.Var(&f.until, "until", fmt.Sprintf("only %s %s before `TIME`: RFC 3339 or a duration ago", t.rows, t.at))
	fs.BoolVar(&f.replayed, "replayed", false, "only "+t.rows+" replayed"+t.replayed)
	fs.BoolVar(&f.notReplayed, "not-replayed", false, "only "+t.rows+" not replayed"+t.replayed)
	if limitUsage != "" {
		fs.IntVar(&f.limit, "limit", limit, limitUsage)
	}
}

// withOps runs fn with an ops client (withOps) for a command that takes
// no arguments, once the filter flags are checked.
func (f *filter) withOps(ctx context.Context, e env, args []string, fn func(*ops.Client) error) error {
	if err := noArgs(args); err != nil {
		return err
	}
	if err := f.check(); err != nil {
		return err
	}
	return withOps(ctx, e, fn)
}

// check reports contradictory or invalid filter flags.
func (f *filter) check() error {
	if f.replayed && f.notReplayed {
		return usagef("--replayed and --not-replayed exclude each other; give one or neither")
	}
	if err := checkLimit(f.limit); err != nil {
		return err
	}
	if f.fingerprint != "" && !ops.IsFingerprint(f.fingerprint) {
		return usagef("--fingerprint %q: want 12 lowercase hex digits, as `millrace dlq groups` shows", f.fingerprint)
	}
	return nil
}

// selects reports whether any criterion (not --limit) is set.
func (f *filter) selects() bool {
	return f.filter() != ops.Filter{}
}

// filter is the filter as the operations API takes it.
func (f *filter) filter() ops.Filter {
	of := ops.Filter{Topic: f.topic, Handler: f.handler, Group: f.group, Reason: f.reason,
		Fingerprint: f.fingerprint, Since: f.since.bound(), Until: f.until.bound()}
	switch {
	case f.replayed:
		of.Replayed = new(true)
	case f.notReplayed:
		of.Replayed = new(false)
	}
	return of
}

// selection is what replay and purge act on: IDs, a filter, or --all.
type selection struct {
	filter
	all bool
	ids []int64
}

func (s *selection) register(fs *flag.FlagSet) {
	s.filter.register(fs, 0, fmt.Sprintf("act on at most `N` matching %s, oldest first (0: no limit)", s.rows))
	fs.BoolVar(&s.all, "all", false, s.tableFlags.all)
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
			return usagef("%q is not a %s ID (a positive integer, as `%s` shows)", a, s.idNoun, s.listCommand)
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
	case kinds == 0:
		filters := "--topic, --reason, --since, --until, --replayed, --not-replayed"
		if s.dlq {
			filters = "--topic, --handler, --group, --reason, --fingerprint, --since, --until, --replayed, --not-replayed"
		}
		return usagef("choose what to %s: %s IDs, filters (%s) or --all", verb, s.idKind, filters)
	case kinds > 1:
		return usagef("give message IDs, filters or --all, not several of them")
	case len(s.ids) > 0 && s.limit > 0:
		return usagef("--limit applies to filters and --all, not to message IDs")
	}
	return nil
}

// selection is the selection as the operations API takes it.
func (s *selection) selection() ops.Selection {
	return ops.Selection{IDs: s.ids, Filter: s.filter.filter(), All: s.all, Limit: s.limit}
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
func (t *timeFlag) bound() ops.TimeBound {
	switch {
	case !t.set:
		return ops.TimeBound{}
	case !t.at.IsZero():
		return ops.At(t.at)
	default:
		return ops.Ago(t.ago)
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
