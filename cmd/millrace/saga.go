package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"sort"
	"time"

	"github.com/millrace-io/millrace/ops"
)

func init() {
	commands = append(commands,
		command{path: "saga list", summary: "saga instances, the most recently changed first: step, version, pending timeouts", bind: bindSagaList},
		command{path: "saga show", args: "SAGA ID", summary: "one saga instance: its state, step, version, pending timeouts and last error", bind: noFlags(runSagaShow)},
	)
}

func bindSagaList(fs *flag.FlagSet) runFunc {
	saga := fs.String("saga", "", "only instances of the saga type `NAME`")
	completed := fs.Bool("completed", false, "include completed instances (kept for their retention)")
	limit := fs.Int("limit", 100, "show at most `N` instances (0: no limit)")
	return func(ctx context.Context, e env, args []string) error {
		read := func(oc *ops.Client) (ops.SagaList, error) {
			return oc.ListSagas(ctx, ops.SagaFilter{Saga: *saga, Completed: *completed}, *limit)
		}
		return runList(ctx, e, args, *limit, read, func(res ops.SagaList) func(io.Writer) {
			l := listed[ops.SagaInstance]{rows: res.Instances, none: "no saga instances match",
				header: "SAGA\tID\tSTEP\tVERSION\tTIMEOUTS\tUPDATED AT\tCOMPLETED", line: sagaLine}
			if res.Truncated {
				l.more = fmt.Sprintf("(more instances match; showing %d, raise --limit to see more)", *limit)
			}
			return l.write
		})
	}
}

// sagaLine is an instance's row in saga list.
func sagaLine(r ops.SagaInstance) string {
	done := "-"
	if r.CompletedAt != nil {
		done = r.CompletedAt.Format(time.RFC3339)
	}
	return fmt.Sprintf("%s\t%s\t%s\t%d\t%d\t%s\t%s", cell(r.Saga, 30), cell(r.ID, 36), cell(r.Step, 30), r.Version,
		len(r.Timeouts), r.UpdatedAt.Format(time.RFC3339), done)
}

func runSagaShow(ctx context.Context, e env, args []string) error {
	if len(args) != 2 {
		return usagef("want a saga type and an instance id; got %d arguments", len(args))
	}
	return withOps(ctx, e, func(oc *ops.Client) error {
		inst, err := oc.Saga(ctx, args[0], args[1])
		if err != nil {
			return err
		}
		return e.print(inst, func(w io.Writer) {
			fmt.Fprintf(w, "saga:       %s\n", inst.Saga)
			fmt.Fprintf(w, "id:         %s\n", inst.ID)
			fmt.Fprintf(w, "step:       %s\n", inst.Step)
			fmt.Fprintf(w, "version:    %d\n", inst.Version)
			fmt.Fprintf(w, "created at: %s\n", inst.CreatedAt.Format(time.RFC3339))
			fmt.Fprintf(w, "updated at: %s\n", inst.UpdatedAt.Format(time.RFC3339))
			if inst.CompletedAt != nil {
				fmt.Fprintf(w, "completed:  %s\n", inst.CompletedAt.Format(time.RFC3339))
			} else {
				fmt.Fprintln(w, "completed:  no (running)")
			}
			names := make([]string, 0, len(inst.Timeouts))
			for n := range inst.Timeouts {
				names = append(names, n)
			}
			sort.Strings(names)
			fmt.Fprintf(w, "timeouts:   %d pending\n", len(names))
			for _, n := range names {
				fmt.Fprintf(w, "  %s: scheduled event %s\n", n, inst.Timeouts[n])
			}
			if e := inst.LastError; e != nil {
				when := "the saga has not moved on since"
				if !e.Current {
					when = "a later step committed since"
				}
				fmt.Fprintf(w, "last error: step %s at %s (%s): %s\n", e.Step, e.FailedAt.Format(time.RFC3339), when, e.Error)
			} else {
				fmt.Fprintln(w, "last error: none")
			}
			if inst.Version == 0 {
				fmt.Fprintln(w, "state:      none (its starting step has not committed)")
				return
			}
			fmt.Fprintf(w, "state:      %s\n", inst.State)
		})
	})
}
