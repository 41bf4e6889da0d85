package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
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
