package main

import (
	"bytes"
	"context"
	"encoding/json"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/ops"
)

// --config and --json are accepted before or after the command.
func TestGlobalFlagsGoBeforeOrAfterTheCommand(t *testing.T) {
	t.Parallel()
	_, _, path := migrated(t)
	for _, args := range [][]string{
		{"--config", path, "--json", "dlq", "list"},
		{"dlq", "list", "--config", path, "--json"},
		{"--json", "dlq", "list", "--config", path},
	} {
		var out, errOut bytes.Buffer
		require.Equal(t, exitOK, run(context.Background(), args, &out, &errOut), "%v: %s", args, errOut.String())
		var list poisonList
		require.NoError(t, json.Unmarshal(out.Bytes(), &list), "%v: %s", args, out.String())
		require.Equal(t, []ops.PoisonedMessage{}, list.Messages)
	}
}

// version needs no config, and says what it was built from.
func TestVersionCommand(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"--config", "/nonexistent/config.yaml", "version"}, &out, &errOut), errOut.String())
	require.True(t, strings.HasPrefix(out.String(), "millrace "), out.String())
	require.Contains(t, out.String(), "built with go1.")
	out.Reset()
	require.Equal(t, exitOK, run(context.Background(), []string{"version", "--json"}, &out, &errOut))
	var v versionInfo
	require.NoError(t, json.Unmarshal(out.Bytes(), &v))
	require.NotEmpty(t, v.Version)
	require.True(t, strings.HasPrefix(v.Go, "go1."), v.Go)
}

// Commands that only need the database run whatever the broker section
// holds (an operator's machine may lack the broker's secrets); the relay,
// which connects to the broker, refuses it.
func TestDatabaseCommandsNeedNoBrokerSection(t *testing.T) {
	t.Parallel()
	_, schema, _ := migrated(t)
	path := writeConfig(t, "database:\n  url: "+testdb.URL()+"\n  schema: "+schema+"\nbroker:\n  kind: rabbitmq\n  rabbitmq:\n    url: ${MILLRACE_TEST_UNSET_AMQP_URL}\n    tls: {enabled: true, ca_file: /nonexistent/ca.pem}\n")
	for _, args := range [][]string{
		{"dlq", "list"}, {"quarantine", "list"}, {"outbox", "status"}, {"migrate"}, {"inbox", "purge", "--older-than", "30d", "--dry-run"},
		{"dlq", "purge", "--all", "--dry-run"}, {"grants", "--role", "svc"},
	} {
		code, _, errOut := cli(t, path, args...)
		require.Equal(t, exitOK, code, "%v: %s", args, errOut)
	}
	code, _, errOut := cli(t, path, "relay")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "broker.rabbitmq")
	bad := writeConfig(t, "database:\n  schema: Not-A-Schema\nbroker:\n  kind: kafak\n")
	code, _, errOut = cli(t, bad, "dlq", "list")
	require.Equal(t, exitUsage, code, "a database problem still stops it")
	require.Contains(t, errOut, "database.schema")
	require.NotContains(t, errOut, "broker.kind")
}

// millrace ui refuses an address other machines reach unless it requires
// authentication, and bad flags, with exit 2.
func TestUICommandBadUsage(t *testing.T) {
	t.Parallel()
	_, _, path := migrated(t)
	for args, reason := range map[string]string{
		"ui --listen 0.0.0.0:0":              "reachable from other machines",
		"ui --listen nowhere":                "want host:port",
		"ui --user ops":                      "MILLRACE_UI_PASSWORD",
		"ui --token-file /nonexistent/token": "--token-file",
		"ui extra":                           "unexpected arguments",
	} {
		code, _, errOut := cli(t, path, strings.Fields(args)...)
		require.Equal(t, exitUsage, code, args)
		require.Contains(t, errOut, reason, args)
	}
}

// dlq groups lists failure groups; --fingerprint selects one, and a
// malformed one is bad usage.
func TestDLQGroupsAndFingerprints(t *testing.T) {
	t.Parallel()
	_, _, path := migrated(t)
	var res struct {
		Groups []ops.FailureGroup `json:"groups"`
	}
	cliJSON(t, path, &res, "dlq", "groups")
	require.Equal(t, []ops.FailureGroup{}, res.Groups)
	code, _, errOut := cli(t, path, "dlq", "list", "--fingerprint", "ZZ")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "--fingerprint")
	code, _, errOut = cli(t, path, "dlq", "replay", "--fingerprint", "0123456789ab", "--dry-run")
	require.Equal(t, exitOK, code, errOut)
}

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
