package middleware_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The chain knows no broker: the adapters, and the runtime that picks their
// subscribers (package consumer), are not among its dependencies.
func TestTheChainDoesNotImportTheAdaptersNorTheRuntime(t *testing.T) {
	t.Parallel()
	const module = "github.com/millrace-io/millrace/"
	out, err := exec.Command("go", "list", "-f", `{{join .Deps "\n"}}`, module+"middleware").Output()
	require.NoError(t, err)
	deps := strings.Split(string(out), "\n")
	require.Contains(t, deps, module+"internal/fault", "go list gave the chain's dependencies")
	require.NotContains(t, deps, module+"middleware/consumer", "the chain imports its runtime")
	require.False(t, slices.ContainsFunc(deps, func(d string) bool { return strings.HasPrefix(d, module+"adapters") }),
		"the chain imports the adapters: %s", deps)
}
