package nats

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/adaptertest"
)

// What a subscriber that goes away held (as a crashed consumer does) comes
// back after ack_wait. On an ordered group it comes back before a message
// published after the crash; on an unordered one (the control) that message
// passes it.
func TestOrderedGroupKeepsOrderAcrossRestart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		ordered bool
		want    []string
	}{
		{"ordered", true, []string{"m0", "m1", "m2"}},
		{"unordered", false, []string{"m2", "m0", "m1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			eachServer(t, func(t *testing.T, url string) {
				ctx := context.Background()
				b := openBroker(t, url, func(c *Config) { c.Consumer.AckWait = 2 * time.Second })
				topic, group := adaptertest.Name("restart"), adaptertest.Name("g")
				require.NoError(t, b.Provision(ctx, topic, group)) // made before the handler was ordered
				require.Equal(t, defaultMaxAckPending, consumerInfo(t, b, topic, group).Config.MaxAckPending)
				if tc.ordered {
					require.NoError(t, b.ProvisionOrdered(ctx, topic, group))
					require.Equal(t, 1, consumerInfo(t, b, topic, group).Config.MaxAckPending, "updated in place")
				}
				require.NoError(t, b.PublishBatch(ctx, batchOf(topic, newMsg("m0"), newMsg("m1"))))

				sub, err := b.Subscriber(group)
				require.NoError(t, err)
				ch, err := sub.Subscribe(ctx, topic)
				require.NoError(t, err)
				require.Equal(t, "m0", next(t, ch).UUID)
				require.NoError(t, sub.Close()) // m0 stays unacked, as with a crash
				require.NoError(t, b.PublishBatch(ctx, batchOf(topic, newMsg("m2"))))

				var got []string
				for _, m := range receiveN(t, subscribeGroup(t, b, topic, group), 3) {
					got = append(got, m.UUID)
				}
				require.Equal(t, tc.want, got)
				if tc.ordered {
					require.Equal(t, 1, consumerInfo(t, b, topic, group).Config.MaxAckPending, "Subscribe kept the ordered setting")
				}
			})
		})
	}
}

// A process whose handler is not ordered finds the group's consumer at
// max_ack_pending 1 and says so, rather than raising it under an ordered
// handler of another process.
func TestUnorderedProvisionOfOrderedGroupConflicts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := sharedURL()
	topic, group := adaptertest.Name("wasordered"), adaptertest.Name("g")
	require.NoError(t, openBroker(t, url, nil).ProvisionOrdered(ctx, topic, group))
	b := openBroker(t, url, nil)
	err := b.Provision(ctx, topic, group)
	require.ErrorIs(t, err, adapters.ErrTopologyConflict)
	require.True(t, adapters.IsPermanent(err))
	require.ErrorContains(t, err, "max_ack_pending is 1 on the server, 32 wanted (broker.nats.consumer.max_ack_pending; a handler with consumer.ordered: true sets 1)")
	require.Equal(t, 1, consumerInfo(t, b, topic, group).Config.MaxAckPending, "left as it was")
}
