// Command millrace operates a millrace installation from the same config.yaml
// the services use.
//
//	millrace [--config config.yaml] migrate
//
// Exit codes: 0 success, 1 the command failed, 2 bad usage or configuration.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/millrace-io/millrace/bus"
)

// Exit codes a script can rely on.
const (
	exitOK      = 0
	exitFailed  = 1
	exitUsage   = 2
	defaultPath = "config.yaml"
)

// usageError marks bad arguments or configuration (exit 2).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

type command struct {
	name, summary string
	run           func(ctx context.Context, cfg bus.Config, args []string, out io.Writer) error
}

var commands = []command{
	{"migrate", "create or update millrace's tables and triggers (idempotent)", runMigrate},
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("millrace", flag.ContinueOnError)
	fs.SetOutput(stderr)
	configPath := fs.String("config", envOr("MILLRACE_CONFIG", defaultPath), "path to config.yaml (env MILLRACE_CONFIG)")
	fs.Usage = func() { usage(fs, stderr) }
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	if fs.NArg() == 0 {
		usage(fs, stderr)
		return exitUsage
	}
	name := fs.Arg(0)
	for _, c := range commands {
		if c.name != name {
			continue
		}
		cfg, err := bus.LoadConfig(*configPath)
		if err != nil {
			fmt.Fprintln(stderr, "millrace:", err)
			return exitUsage
		}
		if err := c.run(ctx, cfg, fs.Args()[1:], stdout); err != nil {
			fmt.Fprintf(stderr, "millrace %s: %v\n", name, err)
			if errors.As(err, new(usageError)) {
				return exitUsage
			}
			return exitFailed
		}
		return exitOK
	}
	fmt.Fprintf(stderr, "millrace: unknown command %q\n", name)
	usage(fs, stderr)
	return exitUsage
}

func usage(fs *flag.FlagSet, w io.Writer) {
	fmt.Fprintln(w, "usage: millrace [--config config.yaml] <command>")
	fmt.Fprintln(w, "\ncommands:")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nflags:")
	fs.PrintDefaults()
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func runMigrate(ctx context.Context, cfg bus.Config, args []string, out io.Writer) error {
	if len(args) > 0 {
		return usageError{fmt.Errorf("migrate takes no arguments, got %q", args)}
	}
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := bus.Migrate(ctx, db, cfg); err != nil {
		return err
	}
	fmt.Fprintf(out, "migrated schema %q (outbox topic %q)\n", cfg.Database.Schema, cfg.Outbox.Topic)
	return nil
}
