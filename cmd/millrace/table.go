package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/millrace-io/millrace/ops"
)

// table is what the dlq and quarantine commands differ in: one
// implementation of list, show, replay and purge runs over either table
// of the operations API with these options.
type table[R, D, E, S any] struct {
	// name is the command group: "dlq", "quarantine".
	name string
	// of is the table in the operations API.
	of func(*ops.Client) ops.Table[R, D, E, S]
	// flags are the words of the filter flags and selection errors.
	flags tableFlags
	// none is what list, replay and purge print when nothing matches.
	none string
	// unit counts rows in messages: "message(s)", "row(s)".
	unit string
	// header and line are the text table of list and purge: its header,
	// and a row's line (columns separated by tabs).
	header string
	line   func(R) string
	// show is the --json value and the text of the show command.
	show func(d D, asHex bool) (any, func(w io.Writer))
	// writeReplay writes the text result of a replay.
	writeReplay func(w io.Writer, res ops.ReplayResult[E, S])
	// forceUsage is the usage of replay's --force.
	forceUsage string
	// purgeQuestion asks whether to purge --all of n rows.
	purgeQuestion func(n int) string
	// summaries are the commands' summaries, by verb.
	summaries map[string]string
}

// commands are the table's list, show, replay and purge commands.
func (t table[R, D, E, S]) commands() []command {
	return []command{
		{path: t.name + " list", summary: t.summaries["list"], bind: t.bindList},
		{path: t.name + " show", args: "ID", summary: t.summaries["show"], bind: t.bindShow},
		{path: t.name + " replay", args: "[ID...]", summary: t.summaries["replay"], bind: t.bindReplay},
		{path: t.name + " purge", args: "[ID...]", summary: t.summaries["purge"], bind: t.bindPurge},
	}
}

func (t table[R, D, E, S]) bindList(fs *flag.FlagSet) runFunc {
	f := filter{tableFlags: t.flags}
	f.register(fs, 100, fmt.Sprintf("show at most `N` %s (0: no limit)", t.flags.rows))
	return func(ctx context.Context, e env, args []string) error {
		return f.withOps(ctx, e, args, func(oc *ops.Client) error {
			res, err := t.of(oc).List(ctx, f.filter(), f.limit)
			if err != nil {
				return err
			}
			l := listed[R]{rows: res.Rows, none: t.none, header: t.header, line: t.line}
			if res.Truncated {
				l.more = fmt.Sprintf("(more %s match; showing %d, raise --limit to see more)", t.flags.rows, f.limit)
			}
			return e.print(map[string]any{t.flags.rows: res.Rows, "truncated": res.Truncated}, l.write)
		})
	}
}

func (t table[R, D, E, S]) bindShow(fs *flag.FlagSet) runFunc {
	asHex := fs.Bool("hex", false, "show a payload that is not JSON in hex instead of base64")
	return func(ctx context.Context, e env, args []string) error {
		id, err := rowID(args, t.flags.idNoun, t.flags.listCommand)
		if err != nil {
			return err
		}
		return withOps(ctx, e, func(oc *ops.Client) error {
			d, err := t.of(oc).Get(ctx, id)
			if err != nil {
				return err
			}
			return e.print(t.show(d, *asHex))
		})
	}
}

func (t table[R, D, E, S]) bindReplay(fs *flag.FlagSet) runFunc {
	sel := selection{filter: filter{tableFlags: t.flags}}
	sel.register(fs)
	dryRun := fs.Bool("dry-run", false, "show what would be replayed; change nothing")
	force := fs.Bool("force", false, t.forceUsage)
	return func(ctx context.Context, e env, args []string) error {
		if err := sel.resolve(args, "replay"); err != nil {
			return err
		}
		return withOps(ctx, e, func(oc *ops.Client) error {
			res, err := t.of(oc).Replay(ctx, sel.selection(), ops.ReplayOptions{DryRun: *dryRun, Force: *force, By: operator()})
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
				if len(res.Replayed) == 0 && len(res.Skipped) == 0 {
					fmt.Fprintln(w, t.none)
					return
				}
				t.writeReplay(w, res)
			})
		})
	}
}

func (t table[R, D, E, S]) bindPurge(fs *flag.FlagSet) runFunc {
	return bindSelected(fs, t.flags, "purge", "deleted", t.purgeQuestion, map[string]string{"purged": "would_purge"},
		func(ctx context.Context, oc *ops.Client, sel ops.Selection, dryRun bool) (ops.PurgeResult[R], int, string, error) {
			res, err := t.of(oc).Purge(ctx, sel, dryRun)
			return res, len(res.Purged), res.Selection, err
		},
		func(res ops.PurgeResult[R]) bool { return res.DryRun }, t.writePurge)
}

// bindSelected binds a command that acts on a selection (IDs, filters or
// --all) with --dry-run, and asks before it acts on --all unless --yes:
// purge and skip. act runs the action and returns its result, how many rows
// it selected and its selection token; renames are the result's JSON keys
// in a dry run.
func bindSelected[Res any](fs *flag.FlagSet, flags tableFlags, verb, changed string, question func(n int) string, renames map[string]string,
	act func(ctx context.Context, oc *ops.Client, sel ops.Selection, dryRun bool) (Res, int, string, error),
	isDryRun func(Res) bool, write func(io.Writer, Res)) runFunc {
	sel := selection{filter: filter{tableFlags: flags}}
	sel.register(fs)
	dryRun := fs.Bool("dry-run", false, "show what would be "+changed+"; change nothing")
	yes := fs.Bool("yes", false, verb+" --all without asking for confirmation")
	return func(ctx context.Context, e env, args []string) error {
		if err := sel.resolve(args, verb); err != nil {
			return err
		}
		return withOps(ctx, e, func(oc *ops.Client) error {
			selected := sel.selection()
			res, err := confirmedPurge(e, sel.all, *dryRun, *yes, question, func(expect string, dryRun bool) (Res, int, string, error) {
				selected.Expect = expect
				return act(ctx, oc, selected, dryRun)
			})
			if err != nil {
				return err
			}
			out, err := dryRunJSON(res, isDryRun(res), renames)
			if err != nil {
				return err
			}
			return e.print(out, func(w io.Writer) { write(w, res) })
		})
	}
}

func (t table[R, D, E, S]) writePurge(w io.Writer, res ops.PurgeResult[R]) {
	summary := fmt.Sprintf("purged %d %s", len(res.Purged), t.unit)
	if res.DryRun {
		summary = fmt.Sprintf("dry run: %d %s would be purged; nothing changed", len(res.Purged), t.unit)
	}
	listed[R]{rows: res.Purged, none: t.none, header: t.header, line: t.line, more: summary}.write(w)
}
