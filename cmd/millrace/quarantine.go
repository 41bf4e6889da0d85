package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/millrace-io/millrace/bus"
)

func init() {
	commands = append(commands,
		command{path: "quarantine list", summary: "list outbox rows the relay set aside (no broker could take them), newest first, with the reason", bind: bindQuarantineList},
		command{path: "quarantine show", args: "ID", summary: "one quarantined row: reason, envelope, the event's metadata and payload", bind: bindQuarantineShow},
		command{path: "quarantine replay", args: "[ID...]", summary: "write quarantined rows back into the outbox as they were (same event id) once the cause is fixed", bind: bindQuarantineReplay},
		command{path: "quarantine purge", args: "[ID...]", summary: "delete quarantined rows", bind: bindQuarantinePurge},
	)
}

func bindQuarantineList(fs *flag.FlagSet) runFunc {
	var f filter
	f.registerQuarantine(fs, 100, "show at most `N` rows (0: no limit)")
	return func(ctx context.Context, e env, args []string) error {
		if err := noArgs(args); err != nil {
			return err
		}
		if err := f.check(); err != nil {
			return err
		}
		return withOps(ctx, e, func(ops *bus.Ops) error {
			res, err := ops.ListQuarantined(ctx, f.quarantineFilter(), f.limit)
			if err != nil {
				return err
			}
			return e.print(res, func(w io.Writer) {
				if len(res.Rows) == 0 {
					fmt.Fprintln(w, "no quarantined rows match")
					return
				}
				writeQuarantineTable(w, res.Rows)
				if res.Truncated {
					fmt.Fprintf(w, "(more rows match; showing %d, raise --limit to see more)\n", f.limit)
				}
			})
		})
	}
}

func writeQuarantineTable(w io.Writer, rows []bus.QuarantinedRow) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tQUARANTINED AT\tTOPIC\tEVENT ID\tOFFSET\tREPLAYED\tREASON")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%d\t%s\n", r.ID, r.QuarantinedAt.Format(time.RFC3339),
			cell(r.Topic, 40), cell(r.EventID, 36), r.OutboxOffset, r.TimesReplayed, cell(r.Reason, 60))
	}
	tw.Flush()
}

// quarantineShowResult is the --json output of quarantine show.
type quarantineShowResult struct {
	bus.QuarantinedRow
	EnvelopeError string            `json:"envelope_error"`
	Metadata      map[string]string `json:"metadata"`
	Payload       payloadView       `json:"payload"`
	Envelope      payloadView       `json:"envelope"`
}

func bindQuarantineShow(fs *flag.FlagSet) runFunc {
	asHex := fs.Bool("hex", false, "show a payload that is not JSON in hex instead of base64")
	return func(ctx context.Context, e env, args []string) error {
		id, err := rowID(args, "quarantined row", "millrace quarantine list")
		if err != nil {
			return err
		}
		return withOps(ctx, e, func(ops *bus.Ops) error {
			d, err := ops.Quarantined(ctx, id)
			if err != nil {
				return err
			}
			res := quarantineShowResult{QuarantinedRow: d.QuarantinedRow, EnvelopeError: d.EnvelopeError,
				Metadata: d.Metadata, Payload: viewPayload(d.Payload, *asHex), Envelope: viewPayload(d.Envelope, *asHex)}
			return e.print(res, func(w io.Writer) {
				field := func(name string, value any) { fmt.Fprintf(w, "%-16s %v\n", name+":", value) }
				field("id", res.ID)
				field("topic", cell(res.Topic, 200))
				field("event id", cell(res.EventID, 200))
				field("outbox offset", res.OutboxOffset)
				field("quarantined at", res.QuarantinedAt.Format(time.RFC3339Nano))
				field("replayed at", timeText(res.ReplayedAt, "never"))
				field("times replayed", res.TimesReplayed)
				fmt.Fprintln(w, "reason:")
				writeIndented(w, res.Reason)
				if res.EnvelopeError != "" {
					fmt.Fprintf(w, "envelope (%d bytes, unreadable: %s)\n", res.Envelope.Bytes, res.EnvelopeError)
					return
				}
				writeMetadata(w, res.Metadata)
				writePayload(w, res.Payload)
			})
		})
	}
}

func bindQuarantineReplay(fs *flag.FlagSet) runFunc {
	var sel selection
	sel.registerQuarantine(fs)
	dryRun := fs.Bool("dry-run", false, "show what would be replayed; change nothing")
	force := fs.Bool("force", false, "also replay rows the configured broker still refuses (the relay quarantines them again)")
	return func(ctx context.Context, e env, args []string) error {
		if err := sel.resolve(args, "replay"); err != nil {
			return err
		}
		return withOps(ctx, e, func(ops *bus.Ops) error {
			res, err := ops.ReplayQuarantined(ctx, sel.quarantineSelection(), bus.ReplayOptions{DryRun: *dryRun, Force: *force, By: operator()})
			if err != nil {
				return err
			}
			if !e.asJSON {
				for _, w := range res.Warnings {
					fmt.Fprintln(e.errOut, "warning:", w)
				}
			}
			out, err := dryRunJSON(res, res.DryRun, map[string]string{"replayed": "would_replay", "skipped": "would_skip", "messages": "would_write"})
			if err != nil {
				return err
			}
			return e.print(out, func(w io.Writer) {
				verb := "replayed"
				if res.DryRun {
					verb = "would replay"
				}
				for _, r := range res.Replayed {
					fmt.Fprintf(w, "%s %d (topic %s, event %s)\n", verb, r.ID, r.Topic, r.EventID)
				}
				for _, s := range res.Skipped {
					fmt.Fprintf(w, "skipped %d (%s): %s\n", s.ID, s.Skip, s.Detail)
				}
				switch {
				case len(res.Replayed) == 0 && len(res.Skipped) == 0:
					fmt.Fprintln(w, "no quarantined rows match")
				case res.DryRun:
					fmt.Fprintf(w, "dry run: %d row(s) would be written to the outbox; nothing changed\n", res.Messages)
				default:
					fmt.Fprintf(w, "%d row(s) written to the outbox; the relay publishes them again\n", res.Messages)
				}
			})
		})
	}
}

func bindQuarantinePurge(fs *flag.FlagSet) runFunc {
	var sel selection
	sel.registerQuarantine(fs)
	dryRun := fs.Bool("dry-run", false, "show what would be deleted; change nothing")
	yes := fs.Bool("yes", false, "purge --all without asking for confirmation")
	return func(ctx context.Context, e env, args []string) error {
		if err := sel.resolve(args, "purge"); err != nil {
			return err
		}
		return withOps(ctx, e, func(ops *bus.Ops) error {
			selected := sel.quarantineSelection()
			question := func(n int) string { return fmt.Sprintf("purge all %d quarantined row(s) for good?", n) }
			res, err := confirmedPurge(e, sel.all, *dryRun, *yes, question, func(expect string, dryRun bool) (bus.QuarantinePurgeResult, int, string, error) {
				selected.Expect = expect
				res, err := ops.PurgeQuarantined(ctx, selected, dryRun)
				return res, len(res.Purged), res.Selection, err
			})
			if err != nil {
				return err
			}
			out, err := dryRunJSON(res, res.DryRun, map[string]string{"purged": "would_purge"})
			if err != nil {
				return err
			}
			return e.print(out, func(w io.Writer) {
				if len(res.Purged) == 0 {
					fmt.Fprintln(w, "no quarantined rows match")
					return
				}
				writeQuarantineTable(w, res.Purged)
				if res.DryRun {
					fmt.Fprintf(w, "dry run: %d row(s) would be purged; nothing changed\n", len(res.Purged))
				} else {
					fmt.Fprintf(w, "purged %d row(s)\n", len(res.Purged))
				}
			})
		})
	}
}
