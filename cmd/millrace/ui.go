package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/millrace-io/millrace/ops"
	"github.com/millrace-io/millrace/ops/console"
)

func init() {
	commands = append(commands, command{
		path:    "ui",
		summary: "serve the web console (outbox, DLQ with failure groups, relay quarantine) on 127.0.0.1 until SIGTERM/SIGINT",
		bind:    bindUI,
	})
}

// Environment variables holding the console's secrets: a flag would show
// them in the process list.
const (
	envUIToken    = "MILLRACE_UI_TOKEN"
	envUIPassword = "MILLRACE_UI_PASSWORD"
)

func bindUI(fs *flag.FlagSet) runFunc {
	listen := fs.String("listen", "127.0.0.1:8080", "serve on `ADDR`; an address other than loopback needs --token-file, "+envUIToken+" or --user")
	readOnly := fs.Bool("read-only", false, "show everything, allow no replay or purge")
	tokenFile := fs.String("token-file", "", "require the access token in `FILE` (or set "+envUIToken+")")
	user := fs.String("user", "", "require HTTP basic authentication as `USER`, with the password in "+envUIPassword)
	return func(ctx context.Context, e env, args []string) error {
		if err := noArgs(args); err != nil {
			return err
		}
		opts := console.Options{ReadOnly: *readOnly, BasicUser: *user, BasicPassword: os.Getenv(envUIPassword), By: "console:" + operator()}
		if *user == "" {
			opts.BasicPassword = ""
		}
		opts.Token = os.Getenv(envUIToken)
		if *tokenFile != "" {
			b, err := os.ReadFile(*tokenFile)
			if err != nil {
				return usagef("--token-file: %v", err)
			}
			opts.Token = strings.TrimSpace(string(b))
			if opts.Token == "" {
				return usagef("--token-file %s is empty", *tokenFile)
			}
		}
		switch {
		case *user != "" && opts.BasicPassword == "":
			return usagef("--user needs the password in %s", envUIPassword)
		case *user != "" && opts.Token != "":
			return usagef("give a token or --user, not both")
		}
		host, _, err := net.SplitHostPort(*listen)
		if err != nil {
			return usagef("--listen %q: want host:port such as 127.0.0.1:8080", *listen)
		}
		if ip := net.ParseIP(host); (ip == nil || !ip.IsLoopback()) && host != "localhost" && opts.Token == "" && *user == "" {
			return usagef("--listen %s is reachable from other machines: require a token (--token-file or %s) or --user", *listen, envUIToken)
		}
		return withOps(ctx, e, func(oc *ops.Client) error { return serveUI(ctx, e, oc, *listen, opts) })
	}
}

func serveUI(ctx context.Context, e env, oc *ops.Client, listen string, opts console.Options) error {
	h, err := console.New(oc, opts)
	if err != nil {
		return err
	}
	defer h.Close()
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	url := "http://" + ln.Addr().String() + "/"
	auth := "no authentication (loopback only)"
	switch {
	case opts.Token != "":
		auth = "token"
	case opts.BasicUser != "":
		auth = "basic authentication as " + opts.BasicUser
	}
	if err := e.print(map[string]any{"status": "serving", "url": url, "read_only": opts.ReadOnly, "auth": auth}, func(w io.Writer) {
		fmt.Fprintf(w, "console at %s (%s%s); stop with SIGTERM\n", url, auth, map[bool]string{true: ", read-only"}[opts.ReadOnly])
	}); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		return err
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
