package adapters_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
)

// CheckSpec names the first field a broker's capabilities do not cover,
// and says why.
func TestCheckSpecNamesTheField(t *testing.T) {
	t.Parallel()
	wait := func(int) time.Duration { return time.Second }
	all := adapters.Capabilities{OrderedFlight: true, ConcurrentFlight: true, ScheduledRedelivery: true}
	for _, c := range []struct {
		caps  adapters.Capabilities
		spec  adapters.SubscriberSpec
		max   int
		field string
		text  string
	}{
		{all, adapters.SubscriberSpec{InFlight: -1}, 0, "InFlight", "must not be negative; got -1"},
		{all, adapters.SubscriberSpec{InFlight: 70000}, 65535, "InFlight", "must be at most 65535 on this broker; got 70000"},
		{adapters.Capabilities{}, adapters.SubscriberSpec{Ordered: true, InFlight: 1}, 0, "Ordered", "no ordered flight"},
		{all, adapters.SubscriberSpec{Ordered: true}, 0, "InFlight", "at least 1 for an ordered subscription; got 0"},
		{all, adapters.SubscriberSpec{Ordered: true, InFlight: 1, RedeliveryWait: wait}, 0, "RedeliveryWait", "ordered"},
		{adapters.Capabilities{}, adapters.SubscriberSpec{InFlight: 2}, 0, "InFlight", "no concurrent flight"},
		{adapters.Capabilities{}, adapters.SubscriberSpec{RedeliveryWait: wait}, 0, "RedeliveryWait", "does not schedule"},
		{adapters.Capabilities{ScheduledRedelivery: true, RedeliveryNeedsFlight: true}, adapters.SubscriberSpec{RedeliveryWait: wait}, 0,
			"InFlight", "RedeliveryNeedsFlight"},
		{all, adapters.SubscriberSpec{Ordered: true, InFlight: 8}, 0, "", ""},
		{all, adapters.SubscriberSpec{InFlight: 8, RedeliveryWait: wait}, 0, "", ""},
	} {
		err := adapters.CheckSpec("kind", c.caps, c.spec, c.max)
		if c.field == "" {
			require.NoError(t, err)
			continue
		}
		var refused *adapters.SpecError
		require.ErrorAs(t, err, &refused)
		require.Equal(t, c.field, refused.Field)
		require.ErrorContains(t, err, "kind: SubscriberSpec."+c.field+": ")
		require.ErrorContains(t, err, c.text)
		require.True(t, adapters.IsPermanent(err))
	}
}
