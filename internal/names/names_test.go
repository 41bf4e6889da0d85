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

func TestSchemaRefusesWhatPostgreSQLReserves(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"pg_temp", "pg_catalog", "pg_toast", "pg_anything", "information_schema", "Public", ""} {
		require.Error(t, Schema(name, 63), name)
	}
	for _, name := range []string{"public", "orders", "pgx", "pg", "information"} {
		require.NoError(t, Schema(name, 63), name)
	}
}

func TestTextRefusesWhatBrokersOrTablesWouldChange(t *testing.T) {
	t.Parallel()
	for _, s := range []string{
		"a\rb", "a\nb", "a\tb", "a\x00b", "a\x1bb", "a\x7fb", "a\u0085b", " a", "a ", "\u00a0a", "a\u2028", "a\u3000",
		"a\xffb", "a\xc3", "\xed\xa0\x80", "\xf4\x90\x80\x80",
	} {
		require.Error(t, Text(s), "%q", s)
	}
	for _, s := range []string{"", "a b", "a  b", "a\u00a0b", "ключ", "🙂", "=?utf-8?b?eA==?=", "a:b;c", "a\u200bb"} {
		require.NoError(t, Text(s), "%q", s)
	}
	require.ErrorContains(t, Text("ab\xff"), "byte 2")
}

func TestValueRefusesOnlyWhatTablesCannotHold(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"a\x00", "\xff", "ok\xc3"} {
		require.Error(t, Value(s), "%q", s)
	}
	for _, s := range []string{"", " lead", "trail ", "a\r\nb", "\t", "\x01\x7f", "ключ 🙂"} {
		require.NoError(t, Value(s), "%q", s)
	}
}

// Derived makes an Identifier of any parts, hostile or long ones too, and
// keeps names that differ only past the cut apart.
func TestDerivedIsAnIdentifier(t *testing.T) {
	t.Parallel()
	require.Equal(t, "millrace_public_events", Derived(63, "millrace", "public", "events"))
	require.Equal(t, "_9a_b_c", Derived(63, "9A.b-c"))
	long := strings.Repeat("x", 80)
	require.NotEqual(t, Derived(63, long, "a"), Derived(63, long, "b"))
	for _, parts := range [][]string{{""}, {"naïve", "a\x00b"}, {long, "a"}, {`x"; DROP`}} {
		name := Derived(63, parts...)
		require.NoError(t, Identifier(name, 63), "%q", parts)
	}
}
