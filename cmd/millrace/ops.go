package main

import (
	"cmp"
	"context"
	"os"
	"os/user"
	"time"

	"github.com/millrace-io/millrace/ops"
)

// withOps connects to database.url, builds the operations API (which
// checks the tables exist) and runs f with it.
func withOps(ctx context.Context, e env, f func(*ops.Client) error) error {
	oc, err := ops.Open(ctx, e.cfg)
	if err != nil {
		return err
	}
	defer oc.Close()
	return f(oc)
}

// operator names who runs the tool, for replay histories.
func operator() string {
	name := os.Getenv("USER")
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	name = cmp.Or(name, "unknown")
	if host, err := os.Hostname(); err == nil && host != "" {
		name += "@" + host
	}
	return name
}

// timeText formats t for text output.
func timeText(t *time.Time, none string) string {
	if t == nil {
		return none
	}
	return t.Format(time.RFC3339)
}
