package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/millrace-io/millrace/ops"
)

func init() {
	commands = append(commands, command{
		path:    "inbox purge",
		summary: "delete inbox rows processed longer ago than --older-than, in short batches",
		bind:    bindInboxPurge,
	})
}

func bindInboxPurge(fs *flag.FlagSet) runFunc {
	var olderThan durationFlag
	fs.Var(&olderThan, "older-than", "required: delete rows processed longer ago than `DURATION` (90m, 720h, 30d)")
	group := fs.String("group", "", "only rows of this consumer `group`")
	batch := fs.Int("batch", 0, "rows per DELETE statement, `N` (default consumer.inbox.cleanup_batch)")
	dryRun := fs.Bool("dry-run", false, "count the rows that would be deleted; change nothing")
	return func(ctx context.Context, e env, args []string) error {
		if err := noArgs(args); err != nil {
			return err
		}
		if olderThan.d == 0 {
			return usagef("--older-than is required: how long ago a row must have been processed to be deleted")
		}
		if flagSet(fs, "batch") && *batch <= 0 {
			return usagef("--batch must be positive; got %d", *batch)
		}
		return withOps(ctx, e, func(oc *ops.Client) error {
			res, err := oc.PruneInbox(ctx, ops.InboxPrune{OlderThan: olderThan.d, Group: *group, Batch: *batch, DryRun: *dryRun})
			if err != nil {
				return err
			}
			if !e.asJSON {
				for _, w := range res.Warnings {
					fmt.Fprintln(e.errOut, "warning:", w)
				}
			}
			out, err := dryRunJSON(res, res.DryRun, map[string]string{"deleted": "would_delete"})
			if err != nil {
				return err
			}
			return e.print(out, func(w io.Writer) {
				scope := "every consumer group"
				if res.Group != "" {
					scope = "consumer group " + res.Group
				}
				if res.DryRun {
					fmt.Fprintf(w, "dry run: %d inbox rows of %s processed more than %s ago would be deleted; nothing changed\n", res.Deleted, scope, res.OlderThan)
				} else {
					fmt.Fprintf(w, "deleted %d inbox rows of %s processed more than %s ago\n", res.Deleted, scope, res.OlderThan)
				}
			})
		})
	}
}

// flagSet reports whether the flag name was given on the command line.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
