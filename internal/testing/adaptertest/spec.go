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
		var refused *adapters.SpecError
		require.ErrorAs(t, err, &refused, c.name)
		require.Equal(t, c.field, refused.Field, "%s: %v", c.name, err)
		require.True(t, adapters.IsPermanent(err), c.name)
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
