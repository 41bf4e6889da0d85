package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/millrace-io/millrace/ops"
)

func init() {
	commands = append(commands,
		command{path: "scheduled list", summary: "events scheduled for later (bus.Schedule), the soonest due first", bind: bindScheduledList},
		command{path: "scheduled cancel", args: "ID", summary: "cancel a scheduled event before it is due: it is never published", bind: noFlags(runScheduledCancel)},
	)
}

func bindScheduledList(fs *flag.FlagSet) runFunc {
	limit := fs.Int("limit", 100, "show at most `N` events (0: no limit)")
	return func(ctx context.Context, e env, args []string) error {
		read := func(oc *ops.Client) (ops.ScheduledList, error) { return oc.ListScheduled(ctx, *limit) }
		return runList(ctx, e, args, *limit, read, func(res ops.ScheduledList) func(io.Writer) {
			l := listed[ops.ScheduledEvent]{rows: res.Events, none: "no scheduled events", header: "DUE AT\tEVENT ID\tTOPIC\tTYPE\tAGGREGATE",
				line: func(r ops.ScheduledEvent) string {
					return fmt.Sprintf("%s\t%s\t%s\t%s\t%s", r.DueAt.Format(time.RFC3339Nano), cell(r.ID, 36), cell(r.Topic, 40),
						cell(r.Type, 40), cell(r.AggregateType+"/"+r.AggregateID, 40))
				}}
			if res.Truncated {
				l.more = fmt.Sprintf("(%d scheduled in all; showing %d, raise --limit to see more)", res.Total, *limit)
			}
			return l.write
		})
	}
}

func runScheduledCancel(ctx context.Context, e env, args []string) error {
	if len(args) != 1 {
		return usagef("want exactly one event ID; got %d arguments", len(args))
	}
	return withOps(ctx, e, func(oc *ops.Client) error {
		if err := oc.CancelScheduled(ctx, args[0]); err != nil {
			return err
		}
		return e.print(map[string]string{"cancelled": args[0]}, func(w io.Writer) {
			fmt.Fprintf(w, "cancelled scheduled event %s\n", args[0])
		})
	})
}
