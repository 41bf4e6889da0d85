package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/ops"
)

func init() {
	commands = append(commands,
		command{path: "migrate", summary: "create or update millrace's tables and triggers (idempotent)", bind: noFlags(runMigrate)},
		command{path: "outbox status", summary: "pending events, oldest pending age, last forwarded, quarantined rows, shards with owners and backlog, and any transaction whose lock the relay waits for", bind: noFlags(runOutboxStatus)},
	)
}

func runMigrate(ctx context.Context, e env, args []string) error {
	if err := noArgs(args); err != nil {
		return err
	}
	db, err := bus.OpenDB(e.cfg.Database)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := bus.Migrate(ctx, db, e.cfg); err != nil {
		return err
	}
	return e.print(map[string]string{"schema": e.cfg.Database.Schema, "outbox_topic": e.cfg.Outbox.Topic}, func(w io.Writer) {
		fmt.Fprintf(w, "migrated schema %q (outbox topic %q)\n", e.cfg.Database.Schema, e.cfg.Outbox.Topic)
	})
}

func runOutboxStatus(ctx context.Context, e env, args []string) error {
	if err := noArgs(args); err != nil {
		return err
	}
	return withOps(ctx, e, func(oc *ops.Client) error {
		st, err := oc.OutboxStatus(ctx, "")
		if err != nil {
			return err
		}
		return e.print(st, func(w io.Writer) {
			fmt.Fprintf(w, "relay group:         %s\n", st.RelayGroup)
			fmt.Fprintf(w, "relayed to:          %s\n", cmp.Or(st.Broker, "(not recorded yet)"))
			fmt.Fprintf(w, "pending:             %d\n", st.Pending)
			fmt.Fprintf(w, "oldest pending age:  %s\n", st.OldestPendingAge.Round(time.Millisecond))
			last := "never (or already cleaned up)"
			if !st.LastForwardedAt.IsZero() {
				last = st.LastForwardedAt.Format(time.RFC3339)
			}
			fmt.Fprintf(w, "last forwarded:      %s\n", last)
			fmt.Fprintf(w, "forwarded, retained: %d\n", st.Forwarded)
			fmt.Fprintf(w, "quarantined:         %d\n", st.Quarantined)
			fmt.Fprintf(w, "shards:              %d\n", st.Shards)
			if len(st.ShardStates) > 0 {
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "SHARD\tOWNER\tPENDING\tOLDEST PENDING")
				for _, s := range st.ShardStates {
					owner := cmp.Or(s.Owner, "(none)")
					fmt.Fprintf(tw, "%d\t%s\t%d\t%s\n", s.Shard, owner, s.Pending, s.OldestPendingAge.Round(time.Millisecond))
				}
				_ = tw.Flush()
			}
			for _, wt := range st.Waits {
				fmt.Fprintf(w, "relay waiting:       %s for a lock held by %s\n", wt.Waited.Round(time.Second), wt)
			}
		})
	})
}
