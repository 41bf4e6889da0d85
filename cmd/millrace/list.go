package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/millrace-io/millrace/ops"
)

// listed is a list command's text: its rows as a table, none when there
// are none, and more after the table when the page is truncated.
type listed[T any] struct {
	rows   []T
	none   string
	header string
	// line is one row: columns separated by tabs, no newline.
	line func(T) string
	// more is "" when the page holds every matching row.
	more string
}

func (l listed[T]) write(w io.Writer) {
	if len(l.rows) == 0 {
		fmt.Fprintln(w, l.none)
		return
	}
	writeTabbed(w, l.header, l.rows, l.line)
	if l.more != "" {
		fmt.Fprintln(w, l.more)
	}
}

// writeTabbed writes header and a line per row, aligned in columns.
func writeTabbed[T any](w io.Writer, header string, rows []T, line func(T) string) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	for _, r := range rows {
		fmt.Fprintln(tw, line(r))
	}
	tw.Flush()
}

// runList runs a list command that takes no arguments and a --limit:
// it prints what read returns, as JSON or as text.
func runList[P any](ctx context.Context, e env, args []string, limit int, read func(*ops.Client) (P, error), text func(P) func(io.Writer)) error {
	if err := errors.Join(noArgs(args), checkLimit(limit)); err != nil {
		return err
	}
	return withOps(ctx, e, func(oc *ops.Client) error {
		res, err := read(oc)
		if err != nil {
			return err
		}
		return e.print(res, text(res))
	})
}
