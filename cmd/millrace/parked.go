package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/millrace-io/millrace/ops"
)

// Parked aggregates are listed under dlq (`dlq parked`), not as a command
// of their own: a park exists only because of a poisoned message, and it
// is released by acting on that message (`dlq replay` or `dlq skip`), so
// the operator finds the park, its poisoned message and the way out in
// one place.

func init() {
	commands = append(commands,
		command{path: "dlq skip", args: "[ID...]", summary: "give up on poisoned messages for good: mark them skipped; the aggregates they parked flow on without them",
			bind: bindSkip},
		command{path: "dlq parked", summary: "aggregates an ordered handler holds parked behind a poisoned message (consumer.poison.park), the longest parked first",
			bind: bindParked})
}

func bindSkip(fs *flag.FlagSet) runFunc {
	question := func(n int) string { return fmt.Sprintf("skip all %d poisoned message(s) for good?", n) }
	return bindSelected(fs, dlq.flags, "skip", "skipped", question, map[string]string{"skipped": "would_skip", "released": "would_release"},
		func(ctx context.Context, oc *ops.Client, sel ops.Selection, dryRun bool) (ops.SkipResult[ops.PoisonedMessage], int, string, error) {
			res, err := oc.DLQ().Skip(ctx, sel, dryRun)
			return res, len(res.Skipped), res.Selection, err
		},
		func(res ops.SkipResult[ops.PoisonedMessage]) bool { return res.DryRun }, writeSkip)
}

func writeSkip(w io.Writer, res ops.SkipResult[ops.PoisonedMessage]) {
	summary := fmt.Sprintf("skipped %d message(s); %d parked aggregate(s) flow on without them", len(res.Skipped), res.Released)
	if res.DryRun {
		summary = fmt.Sprintf("dry run: %d message(s) would be skipped, releasing %d parked aggregate(s); nothing changed", len(res.Skipped), res.Released)
	}
	listed[ops.PoisonedMessage]{rows: res.Skipped, none: dlq.none, header: dlq.header, line: dlq.line, more: summary}.write(w)
}

func bindParked(fs *flag.FlagSet) runFunc {
	var f ops.ParkedFilter
	fs.StringVar(&f.Group, "group", "", "only aggregates parked by this consumer `group`")
	fs.StringVar(&f.Handler, "handler", "", "only aggregates parked by this `handler`")
	fs.StringVar(&f.Key, "key", "", "only this order `key` (aggregate id, or a saga's correlation id)")
	fs.StringVar(&f.State, "state", "", "only parks in this `state`: held (waiting for dlq replay or skip) or draining")
	limit := fs.Int("limit", 100, "show at most `N` parked aggregates (0: no limit)")
	return func(ctx context.Context, e env, args []string) error {
		if err := noArgs(args); err != nil {
			return err
		}
		if f.State != "" && f.State != ops.ParkStateHeld && f.State != ops.ParkStateDraining {
			return usagef("--state: want %s or %s; got %q", ops.ParkStateHeld, ops.ParkStateDraining, f.State)
		}
		return withOps(ctx, e, func(oc *ops.Client) error {
			res, err := oc.Parked(ctx, f, *limit)
			if err != nil {
				return err
			}
			l := listed[ops.ParkedAggregate]{rows: res.Rows, none: "no aggregates are parked",
				header: "GROUP\tHANDLER\tKEY\tSTATE\tPARKED\tSINCE\tPOISON ID\tTOPIC",
				line: func(p ops.ParkedAggregate) string {
					return fmt.Sprintf("%s\t%s\t%s\t%s\t%d\t%s\t%d\t%s", p.ConsumerGroup, p.Handler, cell(p.Key, 40), p.State, p.Parked,
						p.Since.Format(time.RFC3339), p.PoisonID, p.Topic)
				}}
			if res.Truncated {
				l.more = fmt.Sprintf("(more aggregates are parked; showing %d, raise --limit to see more)", *limit)
			} else if len(res.Rows) > 0 {
				l.more = "(release one with `millrace dlq replay POISON_ID` or `millrace dlq skip POISON_ID`)"
			}
			return e.print(map[string]any{"parked": res.Rows, "truncated": res.Truncated}, l.write)
		})
	}
}
