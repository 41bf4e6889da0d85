package main

import (
	"bytes"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

// The version line of an installed release, of a build from a checkout
// (with and without the go command's pseudo-version) and of a build that
// knows nothing about itself.
func TestVersionFormatting(t *testing.T) {
	t.Parallel()
	vcs := func(modified string) []debug.BuildSetting {
		return []debug.BuildSetting{
			{Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: "c3fcec8d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f7"},
			{Key: "vcs.time", Value: "2026-12-04T21:56:00Z"},
			{Key: "vcs.modified", Value: modified},
		}
	}
	for _, tc := range []struct {
		name    string
		bi      *debug.BuildInfo
		version string
		line    string
	}{{
		name:    "go install @v0.1.0",
		bi:      &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Path: "github.com/millrace-io/millrace", Version: "v0.1.0"}},
		version: "v0.1.0",
		line:    "millrace v0.1.0 built with go1.26.8\n",
	}, {
		name:    "checkout with a pseudo-version",
		bi:      &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.1.1-0.20261204215600-c3fcec8d0e1f+dirty"}, Settings: vcs("true")},
		version: "v0.1.1-0.20261204215600-c3fcec8d0e1f+dirty",
		line:    "millrace v0.1.1-0.20261204215600-c3fcec8d0e1f+dirty (commit c3fcec8d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f7, 2026-12-04T21:56:00Z, modified) built with go1.26.8\n",
	}, {
		name:    "checkout without a module version",
		bi:      &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}, Settings: vcs("false")},
		version: "c3fcec8d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f7",
		line:    "millrace c3fcec8d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f7 (commit c3fcec8d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f7, 2026-12-04T21:56:00Z) built with go1.26.8\n",
	}, {
		name:    "modified checkout without a module version",
		bi:      &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}, Settings: vcs("true")},
		version: "c3fcec8d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f7+dirty",
		line:    "millrace c3fcec8d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f7+dirty (commit c3fcec8d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f7, 2026-12-04T21:56:00Z, modified) built with go1.26.8\n",
	}, {
		name:    "no vcs information",
		bi:      &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}},
		version: "(devel)",
		line:    "millrace (devel) built with go1.26.8\n",
	}, {
		name:    "no build information",
		version: "(devel)",
		line:    "millrace (devel)\n",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			v := versionOf(tc.bi)
			require.Equal(t, tc.version, v.Version)
			var out bytes.Buffer
			writeVersion(&out, v)
			require.Equal(t, tc.line, out.String())
		})
	}
}
