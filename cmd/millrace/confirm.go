package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// errNotConfirmed stops a destructive command the operator did not confirm.
var errNotConfirmed = errors.New("not confirmed: nothing was changed (answer yes, or pass --yes)")

// confirm asks question on stderr and reads the answer from the input:
// only "yes" or "y" goes ahead; an empty input (a script) does not.
func confirm(e env, question string) error {
	fmt.Fprintf(e.errOut, "%s [y/N] ", question)
	answer, _ := bufio.NewReader(e.in).ReadString('\n')
	fmt.Fprintln(e.errOut)
	switch strings.ToLower(strings.TrimSpace(answer)) {
	case "y", "yes":
		return nil
	}
	return errNotConfirmed
}

// dryRunJSON is v as --json prints it: for a dry run the fields named in
// renames say what would happen ("deleted" becomes "would_delete").
func dryRunJSON(v any, dryRun bool, renames map[string]string) (any, error) {
	if !dryRun {
		return v, nil
	}
	raw, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		return nil, err
	}
	for from, to := range renames {
		if value, ok := fields[from]; ok {
			delete(fields, from)
			fields[to] = value
		}
	}
	return fields, nil
}

// confirmedPurge runs a purge of the selected rows. For --all without --yes
// or --dry-run it first asks with the count of a dry run (question gets the
// count) and then purges exactly what was counted, passing the dry run's
// Selection token as expect; the purge refuses if the rows changed between.
// purge returns its result, how many rows it (would have) deleted and the
// Selection token.
func confirmedPurge[R any](e env, all, dryRun, yes bool, question func(n int) string,
	purge func(expect string, dryRun bool) (R, int, string, error)) (R, error) {
	expect := ""
	if all && !dryRun && !yes {
		_, n, token, err := purge("", true)
		if err != nil {
			var zero R
			return zero, err
		}
		if err := confirm(e, question(n)); err != nil {
			var zero R
			return zero, err
		}
		expect = token
	}
	res, _, _, err := purge(expect, dryRun)
	return res, err
}

// rowID parses the one ID argument of a show command; what names the rows
// ("poison message") and list the command that shows their IDs.
func rowID(args []string, what, list string) (int64, error) {
	if len(args) != 1 {
		return 0, usagef("want exactly one %s ID; got %d arguments", what, len(args))
	}
	id, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || id <= 0 {
		return 0, usagef("%q is not a %s ID (a positive integer, as `%s` shows)", args[0], what, list)
	}
	return id, nil
}
