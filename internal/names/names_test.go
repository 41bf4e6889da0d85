package names

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestHostileNamesAreRefused(t *testing.T) {
	t.Parallel()
	hostile := []string{
		"", "orders; DROP TABLE users", `x"; DROP SCHEMA public CASCADE; --`, "../etc/passwd",
		"orders\nevents", "orders events", "orders.*", "orders.>", "-leading-dash", ".hidden",
		"naïve", "a\x00b", strings.Repeat("x", MaxTopicLength+1), "$(rm -rf /)", "`id`",
	}
	for _, name := range hostile {
		require.Error(t, Topic(name), "%q", name)
		require.Error(t, Identifier(name, 63), "%q", name)
	}
	for _, name := range []string{"orders.events", "billing-v2", "a_b.c-d", "Orders1"} {
		require.NoError(t, Topic(name), name)
	}
	for _, name := range []string{"public", "millrace_outbox", "_x1"} {
		require.NoError(t, Identifier(name, 63), name)
	}
	for _, name := range []string{"Public", "1abc", "a-b", "a.b", strings.Repeat("x", 64)} {
		require.Error(t, Identifier(name, 63), name)
	}
}
