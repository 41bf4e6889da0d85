package adaptertest

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
)

// testSpecs: Subscriber serves every SubscriberSpec the broker's
// Capabilities cover and refuses each one they do not with a
// *adapters.SpecError naming the field.
func testSpecs(t *testing.T, h Harness) {
	b := newBroker(t, h)
	caps := b.Capabilities()
	group := Name("g")
	wait := func(int) time.Duration { return time.Second }
	cases := []struct {
		name  string
		spec  adapters.SubscriberSpec
		field string // "" when caps cover the spec
	}{
		{"stock", adapters.SubscriberSpec{}, ""},
		{"negative in-flight", adapters.SubscriberSpec{InFlight: -1}, "InFlight"},
		{"ordered", adapters.SubscriberSpec{Ordered: true, InFlight: 4}, want(caps.OrderedFlight, "Ordered")},
		{"ordered without in-flight", adapters.SubscriberSpec{Ordered: true}, pick(caps.OrderedFlight, "InFlight", "Ordered")},
		{"ordered with redelivery wait", adapters.SubscriberSpec{Ordered: true, InFlight: 4, RedeliveryWait: wait},
			pick(caps.OrderedFlight, "RedeliveryWait", "Ordered")},
		{"concurrent", adapters.SubscriberSpec{InFlight: 4}, want(caps.ConcurrentFlight, "InFlight")},
		{"concurrent with redelivery wait", adapters.SubscriberSpec{InFlight: 4, RedeliveryWait: wait},
			pick(caps.ConcurrentFlight, want(caps.ScheduledRedelivery, "RedeliveryWait"), "InFlight")},
		{"redelivery wait", adapters.SubscriberSpec{RedeliveryWait: wait},
			pick(caps.ScheduledRedelivery, want(!caps.RedeliveryNeedsFlight, "InFlight"), "RedeliveryWait")},
	}
	for _, c := range cases {
		c.spec.Group = group
		sub, err := b.Subscriber(c.spec)
		if c.field == "" {
			require.NoError(t, err, c.name)
			require.NoError(t, sub.Close(), c.name)
			continue
		}
		RequireRefused(t, err, c.field, c.name)
	}
}

// want is the field a spec is refused for: "" when the capability covers it.
func want(covered bool, field string) string {
	if covered {
		return ""
	}
	return field
}

// pick is ifTrue when cond holds, else ifFalse.
func pick(cond bool, ifTrue, ifFalse string) string {
	if cond {
		return ifTrue
	}
	return ifFalse
}

// testPingBacklog: a broker with Capabilities.Ping answers Ping; one with
// Capabilities.Backlog counts the messages a new group has not consumed.
func testPingBacklog(t *testing.T, h Harness) {
	ctx, cancel := context.WithTimeout(context.Background(), h.Timeout)
	defer cancel()
	b := newBroker(t, h)
	caps := b.Capabilities()
	if caps.Ping {
		require.NoError(t, b.Ping(ctx))
	}
	if !caps.Backlog {
		return
	}
	topic, group := Name("backlog"), Name("g")
	require.NoError(t, b.Provision(ctx, topic, group))
	publishBatch(t, b, topic, []*message.Message{event("a", 1), event("b", 1)})
	require.Eventually(t, func() bool {
		parts, err := b.Backlog(ctx, topic, group)
		require.NoError(t, err)
		var sum int64
		for _, n := range parts {
			sum += n
		}
		return sum == 2
	}, h.Timeout, 50*time.Millisecond, "the group's backlog is the 2 messages published")
}

// RefusesOrderedInFlight asserts that b refuses an Ordered SubscriberSpec
// with each of inFlight: a permanent *adapters.SpecError naming the InFlight
// field, whose text contains want.
func RefusesOrderedInFlight(t testing.TB, b adapters.Broker, want string, inFlight ...int) {
	t.Helper()
	require.NotEmpty(t, inFlight)
	for _, n := range inFlight {
		_, err := b.Subscriber(adapters.SubscriberSpec{Group: Name("g"), Ordered: true, InFlight: n})
		RequireRefused(t, err, "InFlight", "InFlight %d", n)
		require.ErrorContains(t, err, want, "InFlight %d", n)
	}
}

// RequireRefused asserts that err is a permanent *adapters.SpecError naming
// field; msgAndArgs say which spec was refused, as with require.
func RequireRefused(t testing.TB, err error, field string, msgAndArgs ...any) {
	t.Helper()
	var refused *adapters.SpecError
	require.ErrorAs(t, err, &refused, msgAndArgs...)
	require.Equal(t, field, refused.Field, msgAndArgs...)
	require.True(t, adapters.IsPermanent(err), msgAndArgs...)
}

// ShortFirstWait returns a RedeliveryWait of first after the first delivery
// and an hour after every later one, which sends each delivery number it is
// asked about on asked (buffered for 8).
func ShortFirstWait(first time.Duration) (wait func(n int) time.Duration, asked <-chan int) {
	ch := make(chan int, 8)
	return func(n int) time.Duration {
		ch <- n
		if n == 1 {
			return first
		}
		return time.Hour
	}, ch
}
