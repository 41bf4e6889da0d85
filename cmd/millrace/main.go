// Command millrace operates a millrace installation from the same config.yaml
// the services use.
//
//	millrace [--config config.yaml] migrate
//	millrace [--config config.yaml] outbox status [--json]
//	millrace [--config config.yaml] relay [--metrics ADDR]
//	millrace [--config config.yaml] grants --role NAME
//
// Every command has --help. Exit codes: 0 success, 1 the command failed,
// 2 bad usage or configuration.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/millrace-io/millrace/bus"
)

// Exit codes a script can rely on.
const (
	exitOK     = 0
	exitFailed = 1
	exitUsage  = 2
)

// usageError marks bad arguments (exit 2).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// env is what a command runs with.
type env struct {
	cfg    bus.Config
	out    io.Writer
	asJSON bool
}

// print writes v as indented JSON with --json, else calls text.
func (e env) print(v any, text func(w io.Writer)) error {
	if e.asJSON {
		enc := json.NewEncoder(e.out)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	text(e.out)
	return nil
}

type command struct {
	path    string // e.g. "outbox status"
	args    string // positional arguments, for the usage line
	summary string
	flags   func(fs *flag.FlagSet) // command-specific flags
	run     func(ctx context.Context, e env, args []string) error
}

var commands []command

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	global := flag.NewFlagSet("millrace", flag.ContinueOnError)
	global.SetOutput(stderr)
	configPath := global.String("config", envOr("MILLRACE_CONFIG", "config.yaml"), "path to config.yaml (env MILLRACE_CONFIG)")
	global.Usage = func() { usage(global, stderr) }
	if err := global.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	cmd, rest := find(global.Args())
	if cmd == nil {
		if global.NArg() == 0 {
			fmt.Fprintln(stderr, "millrace: missing command")
		} else {
			fmt.Fprintf(stderr, "millrace: unknown command %q\n", strings.Join(global.Args(), " "))
		}
		usage(global, stderr)
		return exitUsage
	}

	fs := flag.NewFlagSet("millrace "+cmd.path, flag.ContinueOnError)
	fs.SetOutput(stderr)
	asJSON := fs.Bool("json", false, "print JSON instead of text")
	if cmd.flags != nil {
		cmd.flags(fs)
	}
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: millrace [--config config.yaml] %s [flags] %s\n\n%s\n\nflags:\n", cmd.path, cmd.args, cmd.summary)
		fs.PrintDefaults()
	}
	if err := fs.Parse(rest); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	cfg, err := bus.LoadConfig(*configPath)
	if err != nil {
		fmt.Fprintln(stderr, "millrace:", err)
		return exitUsage
	}
	if err := cmd.run(ctx, env{cfg: cfg, out: stdout, asJSON: *asJSON}, fs.Args()); err != nil {
		fmt.Fprintf(stderr, "millrace %s: %v\n", cmd.path, err)
		if errors.As(err, new(usageError)) {
			fs.Usage()
			return exitUsage
		}
		return exitFailed
	}
	return exitOK
}

// find matches the longest command path at the start of args.
func find(args []string) (*command, []string) {
	var best *command
	var rest []string
	for i := range commands {
		words := strings.Fields(commands[i].path)
		if len(words) <= len(args) && strings.Join(args[:len(words)], " ") == commands[i].path {
			if best == nil || len(words) > len(strings.Fields(best.path)) {
				best, rest = &commands[i], args[len(words):]
			}
		}
	}
	return best, rest
}

func usage(fs *flag.FlagSet, w io.Writer) {
	fmt.Fprintln(w, "usage: millrace [--config config.yaml] <command> [flags]")
	fmt.Fprintln(w, "\ncommands (each has --help):")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-16s %s\n", c.path, c.summary)
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

func noArgs(args []string) error {
	if len(args) > 0 {
		return usageError{fmt.Errorf("unexpected arguments %q", args)}
	}
	return nil
}
