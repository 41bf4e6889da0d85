package nats

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestStreamAndConsumerNames(t *testing.T) {
	t.Parallel()
	for topic, want := range map[string]string{
		"orders":              "orders",
		"orders.events":       "orders_events",
		"order-created":       "order--created",
		"billing_v2":          "billing-_v2",
		"a.b-c_d":             "a_b--c-_d",
		"Orders.EU.created.1": "Orders_EU_created_1",
	} {
		require.Equal(t, want, StreamName(topic), topic)
		require.Equal(t, want, ConsumerName(topic), topic)
	}
}

// Every topic gets its own stream name: escaping is one to one, and the
// names are valid JetStream names.
func TestNamesAreDistinctAndValid(t *testing.T) {
	t.Parallel()
	// Every string of up to 4 characters over an alphabet with the three
	// separators, plus a letter and a digit.
	alphabet := []string{".", "-", "_", "a", "1"}
	names := []string{""}
	all := map[string]string{}
	for range 4 {
		var longer []string
		for _, n := range names {
			for _, c := range alphabet {
				longer = append(longer, n+c)
			}
		}
		names = longer
		for _, n := range names {
			s := StreamName(n)
			require.NotContains(t, s, ".", n)
			if prev, dup := all[s]; dup {
				require.Failf(t, "two topics, one stream", "%q and %q are both %q", prev, n, s)
			}
			all[s] = n
		}
	}
	require.Len(t, all, 5+25+125+625)
}

func TestLongNamesStayUnderTheLimit(t *testing.T) {
	t.Parallel()
	a := strings.Repeat("a-b.", 62)          // 248 characters
	b := strings.Repeat("a-b.", 61) + "a-b_" // differs in the last characters only
	sa, sb := StreamName(a), StreamName(b)
	require.LessOrEqual(t, len(sa), 255)
	require.Len(t, sa, maxNameLen+1)
	require.NotEqual(t, sa, sb)
	require.Regexp(t, `-h[0-9a-f]{16}$`, sa)
	require.Equal(t, sa, StreamName(a), "deterministic")
	short := strings.Repeat("x", maxNameLen)
	require.Equal(t, short, StreamName(short), "a name that fits is not hashed")
}

func TestCheckTopic(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"orders", "orders.events", "a-b_c.d1"} {
		require.NoError(t, checkTopic(ok))
	}
	for _, bad := range []string{"", "orders..events", "orders.", ".orders", "orders.*", "orders.>", "a b", strings.Repeat("x", 250)} {
		require.Error(t, checkTopic(bad), bad)
	}
}
