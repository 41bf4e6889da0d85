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
	in     io.Reader // answers to confirmation prompts
	out    io.Writer
	errOut io.Writer // warnings and prompts; already redacted
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
	// broker says the command connects to the broker: only then does a
	// problem of the config's broker section stop it.
	broker bool
	// noConfig says the command reads no config at all.
	noConfig bool
	// bind registers the command's flags on a fresh FlagSet and returns the
	// function that runs the command with their values, so that concurrent
	// runs (tests) share no flag variables.
	bind func(fs *flag.FlagSet) runFunc
}

// noFlags binds a command without flags of its own.
func noFlags(run runFunc) func(*flag.FlagSet) runFunc {
	return func(*flag.FlagSet) runFunc { return run }
}

// stringFlag binds a command whose one flag of its own is the string flag
// name (default ""), and runs run with its value.
func stringFlag(name, usage string, run func(context.Context, env, []string, string) error) func(*flag.FlagSet) runFunc {
	return func(fs *flag.FlagSet) runFunc {
		v := fs.String(name, "", usage)
		return func(ctx context.Context, e env, args []string) error { return run(ctx, e, args, *v) }
	}
}

var commands []command

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := runIO(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run runs the tool with no input for prompts (they are answered no).
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runIO(ctx, args, strings.NewReader(""), stdout, stderr)
}

// globalFlags are the flags every command accepts, before or after it.
type globalFlags struct {
	config string
	asJSON bool
}

func (g *globalFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&g.config, "config", g.config, "path to config.yaml (env MILLRACE_CONFIG)")
	fs.BoolVar(&g.asJSON, "json", g.asJSON, "print JSON instead of text")
}

func runIO(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	g := &globalFlags{config: envOr("MILLRACE_CONFIG", "config.yaml")}
	global := flag.NewFlagSet("millrace", flag.ContinueOnError)
	global.SetOutput(io.Discard) // help goes to stdout, errors to stderr, both below
	g.register(global)
	if err := global.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			usage(global, stdout, "")
			return exitOK
		}
		fmt.Fprintln(stderr, "millrace:", err)
		usage(global, stderr, "")
		return exitUsage
	}
	cmd, rest := find(global.Args())
	if cmd == nil {
		return noCommand(global, stdout, stderr)
	}

	fs := flag.NewFlagSet("millrace "+cmd.path, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	g.register(fs) // after the command too, overriding what came before it
	runCmd := cmd.bind(fs)
	cmdUsage := func(w io.Writer) {
		fmt.Fprintf(w, "usage: millrace [--config config.yaml] %s [flags] %s\n\n%s\n\nflags:\n", cmd.path, cmd.args, cmd.summary)
		fs.SetOutput(w)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	positional, err := parseInterleaved(fs, rest)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			cmdUsage(stdout)
			return exitOK
		}
		fmt.Fprintf(stderr, "millrace %s: %v\n", cmd.path, err)
		cmdUsage(stderr)
		return exitUsage
	}
	var cfg bus.Config
	if !cmd.noConfig {
		cfg, err = bus.LoadConfig(g.config)
		if !cmd.broker {
			err = withoutBrokerProblems(err)
		}
	}
	redacted := &redactingWriter{w: stderr, secrets: secretsOf(cfg)}
	if err != nil {
		fmt.Fprintln(redacted, "millrace:", err)
		return exitUsage
	}
	e := env{cfg: cfg, in: stdin, out: stdout, errOut: redacted, asJSON: g.asJSON}
	if err := runCmd(ctx, e, positional); err != nil {
		fmt.Fprintf(redacted, "millrace %s: %v\n", cmd.path, err)
		if errors.As(err, new(usageError)) {
			cmdUsage(redacted)
			return exitUsage
		}
		return exitFailed
	}
	return exitOK
}

// withoutBrokerProblems drops the problems of the broker section from a
// config error, for commands that never connect to the broker: an
// operator's machine may lack the broker's secrets or certificates.
func withoutBrokerProblems(err error) error {
	var ce *bus.ConfigError
	if !errors.As(err, &ce) {
		return err
	}
	kept := *ce
	kept.Problems = nil
	for _, p := range ce.Problems {
		var fe *bus.FieldError
		if errors.As(p, &fe) && (fe.Path == "broker" || strings.HasPrefix(fe.Path, "broker.")) {
			continue
		}
		kept.Problems = append(kept.Problems, p)
	}
	if len(kept.Problems) == 0 {
		return nil
	}
	return &kept
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
// lists the dlq commands on stdout.
func noCommand(global *flag.FlagSet, stdout, stderr io.Writer) int {
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
		usage(global, stdout, group)
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
	fs.SetOutput(w)
	defer fs.SetOutput(io.Discard)
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
	order := []string{"migrate", "outbox", "relay", "dlq", "quarantine", "scheduled", "saga", "inbox", "grants", "ui", "version"}
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

// checkLimit refuses a negative --limit of a list command.
func checkLimit(limit int) error {
	if limit < 0 {
		return usagef("--limit must not be negative; got %d", limit)
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
