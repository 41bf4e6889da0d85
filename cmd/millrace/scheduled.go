package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
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
		if err := errors.Join(noArgs(args), checkLimit(*limit)); err != nil {
			return err
		}
		return withOps(ctx, e, func(oc *ops.Client) error {
			res, err := oc.ListScheduled(ctx, *limit)
			if err != nil {
				return err
			}
			return e.print(res, func(w io.Writer) {
				if len(res.Events) == 0 {
					fmt.Fprintln(w, "no scheduled events")
					return
				}
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "DUE AT\tEVENT ID\tTOPIC\tTYPE\tAGGREGATE")
				for _, r := range res.Events {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", r.DueAt.Format(time.RFC3339Nano), cell(r.ID, 36), cell(r.Topic, 40),
						cell(r.Type, 40), cell(r.AggregateType+"/"+r.AggregateID, 40))
				}
				tw.Flush()
				if res.Truncated {
					fmt.Fprintf(w, "(%d scheduled in all; showing %d, raise --limit to see more)\n", res.Total, *limit)
				}
			})
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
