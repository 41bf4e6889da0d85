package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"slices"
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

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// env is what a command runs with.
type env struct {
	cfg    bus.Config
	out    io.Writer
	errOut io.Writer // warnings; already redacted
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

// runFunc runs a command with its positional arguments.
type runFunc func(ctx context.Context, e env, args []string) error

type command struct {
	path    string // e.g. "outbox status"
	args    string // positional arguments, for the usage line
	summary string
	// bind registers the command's flags on a fresh FlagSet and returns the
	// function that runs the command with their values, so that concurrent
	// runs (tests) share no flag variables.
	bind func(fs *flag.FlagSet) runFunc
}

// noFlags binds a command without flags of its own.
func noFlags(run runFunc) func(*flag.FlagSet) runFunc {
	return func(*flag.FlagSet) runFunc { return run }
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
	global.Usage = func() { usage(global, stderr, "") }
	if err := global.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	cmd, rest := find(global.Args())
	if cmd == nil {
		return noCommand(global, stderr)
	}

	fs := flag.NewFlagSet("millrace "+cmd.path, flag.ContinueOnError)
	fs.SetOutput(stderr)
	asJSON := fs.Bool("json", false, "print JSON instead of text")
	runCmd := cmd.bind(fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: millrace [--config config.yaml] %s [flags] %s\n\n%s\n\nflags:\n", cmd.path, cmd.args, cmd.summary)
		fs.PrintDefaults()
	}
	positional, err := parseInterleaved(fs, rest)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	cfg, err := bus.LoadConfig(*configPath)
	redacted := &redactingWriter{w: stderr, secrets: secretsOf(cfg)}
	if err != nil {
		fmt.Fprintln(redacted, "millrace:", err)
		return exitUsage
	}
	e := env{cfg: cfg, out: stdout, errOut: redacted, asJSON: *asJSON}
	if err := runCmd(ctx, e, positional); err != nil {
		fmt.Fprintf(redacted, "millrace %s: %v\n", cmd.path, err)
		if errors.As(err, new(usageError)) {
			fs.Usage()
			return exitUsage
		}
		return exitFailed
	}
	return exitOK
}

// parseInterleaved parses flags that may come before, between or after the
// positional arguments (the flag package stops at the first positional one);
// everything after "--" is positional.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return positional, nil
		}
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(positional, rest...), nil
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
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

// noCommand explains a missing or unknown command; "millrace dlq --help"
// lists the dlq commands.
func noCommand(global *flag.FlagSet, stderr io.Writer) int {
	args := global.Args()
	if len(args) == 0 {
		fmt.Fprintln(stderr, "millrace: missing command")
		usage(global, stderr, "")
		return exitUsage
	}
	group := args[0]
	var subs []string
	for _, c := range commands {
		if first, sub, ok := strings.Cut(c.path, " "); ok && first == group {
			subs = append(subs, sub)
		}
	}
	switch {
	case len(subs) > 0 && len(args) > 1 && slices.Contains([]string{"-h", "-help", "--help"}, args[1]):
		usage(global, stderr, group)
		return exitOK
	case len(subs) > 0 && len(args) == 1:
		fmt.Fprintf(stderr, "millrace: %s needs a subcommand: %s\n", group, strings.Join(subs, ", "))
		usage(global, stderr, group)
	default:
		fmt.Fprintf(stderr, "millrace: unknown command %q\n", strings.Join(args, " "))
		usage(global, stderr, "")
	}
	return exitUsage
}

// usage prints the usage line and the commands (those of group when it is set).
func usage(fs *flag.FlagSet, w io.Writer, group string) {
	if group == "" {
		fmt.Fprintln(w, "usage: millrace [--config config.yaml] <command> [flags]")
	} else {
		fmt.Fprintf(w, "usage: millrace [--config config.yaml] %s <command> [flags]\n", group)
	}
	fmt.Fprintln(w, "\ncommands (each has --help and --json):")
	for _, c := range sortedCommands() {
		if group == "" || strings.HasPrefix(c.path, group+" ") {
			fmt.Fprintf(w, "  %-16s %s\n", c.path, c.summary)
		}
	}
	fmt.Fprintln(w, "\nflags:")
	fs.PrintDefaults()
	fmt.Fprintln(w, "\nexit codes: 0 ok, 1 the command failed, 2 bad usage or configuration")
}

// sortedCommands returns the commands in the order an operator meets them.
func sortedCommands() []command {
	order := []string{"migrate", "outbox", "relay", "dlq", "quarantine", "inbox"}
	rank := func(c command) int {
		first, _, _ := strings.Cut(c.path, " ")
		if i := slices.Index(order, first); i >= 0 {
			return i
		}
		return len(order)
	}
	sorted := slices.Clone(commands)
	slices.SortStableFunc(sorted, func(a, b command) int { return rank(a) - rank(b) })
	return sorted
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func noArgs(args []string) error {
	if len(args) > 0 {
		return usagef("unexpected arguments %q", args)
	}
	return nil
}

// secretsOf returns, for every URL in cfg that holds a password, the
// replacements that hide it: the whole URL by its redacted form, then
// "user:password@" and "password=..." wherever they appear alone.
func secretsOf(cfg bus.Config) []string {
	var pairs []string
	for _, raw := range []string{cfg.Database.URL, cfg.Broker.RabbitMQ.URL, cfg.Broker.NATS.URL} {
		u, err := url.Parse(raw)
		if err != nil || raw == "" {
			continue
		}
		if pw, ok := u.User.Password(); ok && pw != "" {
			pairs = append(pairs, raw, u.Redacted(),
				u.User.Username()+":"+pw+"@", u.User.Username()+":xxxxx@",
				u.User.Username()+":"+url.QueryEscape(pw)+"@", u.User.Username()+":xxxxx@")
		}
		if pw := u.Query().Get("password"); pw != "" {
			pairs = append(pairs, "password="+pw, "password=xxxxx",
				"password="+url.QueryEscape(pw), "password=xxxxx")
		}
	}
	return pairs
}

// redactingWriter hides the secrets of the configured URLs in what the tool
// writes to stderr (errors of the database driver or a broker client may
// quote a URL).
type redactingWriter struct {
	w       io.Writer
	secrets []string // old, new pairs for strings.Replacer
}

func (r *redactingWriter) Write(p []byte) (int, error) {
	if len(r.secrets) == 0 {
		return r.w.Write(p)
	}
	if _, err := io.WriteString(r.w, strings.NewReplacer(r.secrets...).Replace(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}
