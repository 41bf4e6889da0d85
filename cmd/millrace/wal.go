package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/millrace-io/millrace/forwarder/wal"
	"github.com/millrace-io/millrace/ops"
)

func init() {
	commands = append(commands,
		command{path: "wal status", summary: "the WAL relay's replication slot (relay.source: wal): active, wal_status, LSNs and the WAL it keeps on the server's disk", bind: noFlags(runWALStatus)},
		command{path: "wal create-slot", summary: "check the WAL relay's requirements and create its publication and replication slot (the relay creates them at start too)", bind: noFlags(runWALCreateSlot)},
		command{path: "wal drop-slot", summary: "drop the WAL relay's replication slot, releasing the WAL it keeps (stop the relays first)", bind: bindWALDropSlot},
	)
}

func runWALStatus(ctx context.Context, e env, args []string) error {
	return runWALSlot(ctx, e, args, (*ops.Client).WALStatus, "")
}

func runWALCreateSlot(ctx context.Context, e env, args []string) error {
	return runWALSlot(ctx, e, args, (*ops.Client).CreateWALSlot,
		"created the slot; the relay streams from it and forwards first what the outbox table holds")
}

// runWALSlot runs do and prints the slot it returns, after head when set.
func runWALSlot(ctx context.Context, e env, args []string, do func(*ops.Client, context.Context) (ops.WALSlot, error), head string) error {
	if err := noArgs(args); err != nil {
		return err
	}
	return withOps(ctx, e, func(oc *ops.Client) error {
		st, err := do(oc, ctx)
		if err != nil {
			return err
		}
		return e.print(st, func(w io.Writer) {
			if head != "" {
				fmt.Fprintln(w, head)
			}
			writeWALSlot(w, st)
		})
	})
}

func bindWALDropSlot(fs *flag.FlagSet) runFunc {
	yes := fs.Bool("yes", false, "drop without asking for confirmation")
	return func(ctx context.Context, e env, args []string) error {
		if err := noArgs(args); err != nil {
			return err
		}
		return withOps(ctx, e, func(oc *ops.Client) error {
			st, err := oc.WALStatus(ctx)
			if err != nil {
				return err
			}
			if !st.Exists {
				return fmt.Errorf("millrace: %w: %q", wal.ErrNoSlot, st.Name)
			}
			if !*yes {
				question := fmt.Sprintf("Drop replication slot %q, which keeps %s of WAL? A relay started again creates a new slot "+
					"and forwards what the outbox table still holds.", st.Name, bytesText(st.RetainedBytes))
				if err := confirm(e, question); err != nil {
					return err
				}
			}
			if err := oc.DropWALSlot(ctx); err != nil {
				return err
			}
			return e.print(map[string]any{"dropped": st.Name, "released_bytes": st.RetainedBytes}, func(w io.Writer) {
				fmt.Fprintf(w, "dropped slot %q (released %s of WAL)\n", st.Name, bytesText(st.RetainedBytes))
			})
		})
	}
}

// writeWALSlot prints st as text.
func writeWALSlot(w io.Writer, st ops.WALSlot) {
	fmt.Fprintf(w, "slot:                 %s\n", st.Name)
	if !st.Exists {
		fmt.Fprintln(w, "exists:               no (the relay creates it at start, or `millrace wal create-slot`)")
		return
	}
	fmt.Fprintf(w, "active:               %t\n", st.Active)
	fmt.Fprintf(w, "wal_status:           %s\n", st.WALStatus)
	fmt.Fprintf(w, "restart_lsn:          %s\n", st.RestartLSN)
	fmt.Fprintf(w, "confirmed_flush_lsn:  %s\n", st.ConfirmedFlushLSN)
	fmt.Fprintf(w, "retained WAL:         %s\n", bytesText(st.RetainedBytes))
	if st.WALStatus == "lost" {
		fmt.Fprintln(w, "the slot was invalidated and can never be read again: see docs/WAL.md, then `millrace wal drop-slot`")
	}
}

// bytesText is n bytes in a readable unit.
func bytesText(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
