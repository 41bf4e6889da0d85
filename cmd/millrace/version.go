package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"runtime/debug"
)

func init() {
	commands = append(commands, command{
		path:     "version",
		summary:  "print millrace's version, the commit it was built from and the Go version",
		noConfig: true,
		bind:     noFlags(runVersion),
	})
}

// versionInfo is the --json output of version.
type versionInfo struct {
	// Version is the module version ("(devel)" for a build from a checkout).
	Version string `json:"version"`
	// Commit and CommitTime say what a build from a checkout was built from;
	// Modified, that the checkout had uncommitted changes.
	Commit     string `json:"commit"`
	CommitTime string `json:"commit_time"`
	Modified   bool   `json:"modified"`
	Go         string `json:"go"`
}

func runVersion(_ context.Context, e env, args []string) error {
	if err := noArgs(args); err != nil {
		return err
	}
	v := versionInfo{Version: "unknown"}
	if bi, ok := debug.ReadBuildInfo(); ok {
		v.Version, v.Go = cmp.Or(bi.Main.Version, "(devel)"), bi.GoVersion
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				v.Commit = s.Value
			case "vcs.time":
				v.CommitTime = s.Value
			case "vcs.modified":
				v.Modified = s.Value == "true"
			}
		}
	}
	return e.print(v, func(w io.Writer) {
		fmt.Fprintf(w, "millrace %s", v.Version)
		if v.Commit != "" {
			fmt.Fprintf(w, " (commit %s, %s%s)", v.Commit, v.CommitTime, map[bool]string{true: ", modified"}[v.Modified])
		}
		fmt.Fprintf(w, " built with %s\n", v.Go)
	})
}
