package main

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// filter selects rows of the poison table; list, replay and purge share it.
type filter struct {
	topic, handler, group, reason string
	since, until                  timeFlag
	replayed, notReplayed         bool
	limit                         int
}

func (f *filter) register(fs *flag.FlagSet, limit int, limitUsage string) {
	fs.StringVar(&f.topic, "topic", "", "only messages of this source `topic`")
	fs.StringVar(&f.handler, "handler", "", "only messages of this `handler`")
	fs.StringVar(&f.group, "group", "", "only messages of this consumer `group`")
	fs.StringVar(&f.reason, "reason", "", "only messages whose failure reason contains `text` (case-insensitive)")
	fs.Var(&f.since, "since", "only messages poisoned at or after `TIME`: RFC 3339 (2025-05-01T12:00:00Z) or a duration ago (90m, 2h, 7d)")
	fs.Var(&f.until, "until", "only messages poisoned before `TIME`: RFC 3339 or a duration ago")
	fs.BoolVar(&f.replayed, "replayed", false, "only messages replayed since they were last poisoned")
	fs.BoolVar(&f.notReplayed, "not-replayed", false, "only messages not replayed since they were last poisoned")
	fs.IntVar(&f.limit, "limit", limit, limitUsage)
}

// check reports contradictory or invalid filter flags.
func (f *filter) check() error {
	if f.replayed && f.notReplayed {
		return usagef("--replayed and --not-replayed exclude each other; give one or neither")
	}
	if f.limit < 0 {
		return usagef("--limit must not be negative; got %d", f.limit)
	}
	return nil
}

// selects reports whether any criterion (not --limit) is set.
func (f *filter) selects() bool {
	return f.topic != "" || f.handler != "" || f.group != "" || f.reason != "" ||
		f.since.set || f.until.set || f.replayed || f.notReplayed
}

// where returns the SQL conditions on the poison table p, appending their
// arguments to args.
func (f *filter) where(args *[]any) []string {
	var conds []string
	arg := func(v any) string {
		*args = append(*args, v)
		return "$" + strconv.Itoa(len(*args))
	}
	if f.topic != "" {
		conds = append(conds, "p.source_topic = "+arg(f.topic))
	}
	if f.handler != "" {
		conds = append(conds, "p.handler = "+arg(f.handler))
	}
	if f.group != "" {
		conds = append(conds, "p.consumer_group = "+arg(f.group))
	}
	if f.reason != "" {
		conds = append(conds, "strpos(lower(p.reason), lower("+arg(f.reason)+")) > 0")
	}
	if f.since.set {
		conds = append(conds, "p.poisoned_at >= "+f.since.sql(arg))
	}
	if f.until.set {
		conds = append(conds, "p.poisoned_at < "+f.until.sql(arg))
	}
	if f.replayed {
		conds = append(conds, "p.replayed_at IS NOT NULL")
	}
	if f.notReplayed {
		conds = append(conds, "p.replayed_at IS NULL")
	}
	return conds
}

// selection is what replay and purge act on: IDs, a filter, or --all.
type selection struct {
	filter
	all bool
	ids []int64
}

func (s *selection) register(fs *flag.FlagSet) {
	s.filter.register(fs, 0, "act on at most `N` matching messages, oldest first (0: no limit)")
	fs.BoolVar(&s.all, "all", false, "select every message of the poison table (instead of IDs or filters)")
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
	case kinds == 0:
		return usagef("choose what to %s: message IDs, filters (--topic, --handler, --group, --reason, --since, --until, --replayed, --not-replayed) or --all", verb)
	case kinds > 1:
		return usagef("give message IDs, filters or --all, not several of them")
	case len(s.ids) > 0 && s.limit > 0:
		return usagef("--limit applies to filters and --all, not to message IDs")
	}
	return nil
}

// where returns the SQL conditions of the selection (none for --all).
func (s *selection) where(args *[]any) []string {
	if len(s.ids) > 0 {
		*args = append(*args, s.ids)
		return []string{fmt.Sprintf("p.id = ANY($%d)", len(*args))}
	}
	return s.filter.where(args)
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

func (t *timeFlag) sql(arg func(any) string) string {
	if !t.at.IsZero() {
		return arg(t.at)
	}
	return "now() - make_interval(secs => " + arg(t.ago.Seconds()) + ")"
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
