package main

import (
	"context"
	"fmt"
	"io"
	"runtime/debug"
	"strings"
)

func init() {
	commands = append(commands, command{
		path:     "version",
		summary:  "print millrace's version, the commit it was built from and the Go version",
		noConfig: true,
		bind:     noFlags(runVersion),
	})
}

// develVersion is the version of a build that knows neither its module
// version nor its commit.
const develVersion = "(devel)"

// versionInfo is the --json output of version.
type versionInfo struct {
	// Version is the module version: v0.1.0 when installed with
	// `go install github.com/millrace-io/millrace/cmd/millrace@v0.1.0`, the
	// pseudo-version the go command stamps on a build from a checkout, or,
	// without either, the commit ("+dirty" with uncommitted changes), else
	// "(devel)".
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
	bi, _ := debug.ReadBuildInfo() // nil when the binary has none
	v := versionOf(bi)
	return e.print(v, func(w io.Writer) { writeVersion(w, v) })
}

// versionOf reads the version from a binary's build information (nil when
// the binary has none): the main module's version when the go command
// stamped one, else the commit from the vcs settings, else "(devel)".
func versionOf(bi *debug.BuildInfo) versionInfo {
	v := versionInfo{Version: develVersion}
	if bi == nil {
		return v
	}
	v.Go = bi.GoVersion
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
	switch {
	case bi.Main.Version != "" && bi.Main.Version != develVersion:
		v.Version = bi.Main.Version
	case v.Commit != "":
		v.Version = v.Commit
		if v.Modified {
			v.Version += "+dirty"
		}
	}
	return v
}

// writeVersion writes v as one line: "millrace v0.1.0 built with go1.26.0"
// for an installed release, with the commit, its time and whether the
// checkout was modified in parentheses for a build from a checkout.
func writeVersion(w io.Writer, v versionInfo) {
	fmt.Fprintf(w, "millrace %s", v.Version)
	if v.Commit != "" {
		details := []string{"commit " + v.Commit}
		if v.CommitTime != "" {
			details = append(details, v.CommitTime)
		}
		if v.Modified {
			details = append(details, "modified")
		}
		fmt.Fprintf(w, " (%s)", strings.Join(details, ", "))
	}
	if v.Go != "" {
		fmt.Fprintf(w, " built with %s", v.Go)
	}
	fmt.Fprintln(w)
}
