package nats

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
)

// A server killed before it wrote the consumer's state to disk comes back
// with the consumer at the start of the stream. The messages the client
// still had queued from before are past the consumer's delivered position,
// and nats-server 2.10 and later never answer their acks. Each such ack
// waiting out its 5s must not hold up the messages behind it: every message
// arrives well within the wait, instead of after 32 × 5s.
func TestKilledServerLosingConsumerStateDoesNotStallDelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	proc := servers.StartNATS(t)
	b := openBroker(t, proc.URL, suiteConfig)
	topic, group := adaptertest.Name("lostate"), adaptertest.Name("g")
	require.NoError(t, b.Provision(ctx, topic, group))
	ch := adaptertest.Subscribe(t, b, topic, group)

	want := map[string]bool{}
	batch := func(round int) []adapters.Outgoing {
		var msgs []*message.Message
		for i := range 200 {
			m := newMsg(fmt.Sprintf("r%d-%d", round, i))
			want[m.UUID] = true
			msgs = append(msgs, m)
		}
		return adaptertest.Outgoing(topic, msgs...)
	}
	require.NoError(t, b.PublishBatch(ctx, batch(1)))
	for range 100 { // far past what the restarted consumer delivers first (max_ack_pending)
		m := adaptertest.Next(t, ch, time.Minute)
		delete(want, m.UUID)
		m.Ack()
	}
	// The client now holds up to max_ack_pending (32) delivered, unacked messages.
	require.Eventually(t, func() bool {
		return consumerInfo(t, b, topic, group).NumAckPending == defaultMaxAckPending
	}, 30*time.Second, 50*time.Millisecond)

	proc.Kill()
	removed := 0
	require.NoError(t, filepath.WalkDir(proc.StoreDir(), func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Name() == "o.dat" && filepath.Base(filepath.Dir(path)) == ConsumerName(group) {
			removed++
			return os.Remove(path) // the consumer's state, as a crash before its flush leaves it
		}
		return nil
	}))
	require.Equal(t, 1, removed, "the consumer's state file in the store")
	proc.Start()

	out := batch(2)
	require.Eventually(t, func() bool { return b.PublishBatch(ctx, out) == nil }, 60*time.Second, 200*time.Millisecond)
	// The contract's bound for messages after a restart; without the
	// acks beside the callback the 32 unanswered acks alone take 160s.
	deadline := time.After(60 * time.Second)
	for len(want) > 0 {
		select {
		case m := <-ch:
			delete(want, m.UUID) // redeliveries are allowed
			m.Ack()
		case <-deadline:
			require.FailNow(t, "delivery stalled", "%d messages never arrived after the restart", len(want))
		}
	}
	require.Eventually(t, func() bool {
		ci := consumerInfo(t, b, topic, group)
		return ci.NumAckPending == 0 && ci.NumPending == 0
	}, 30*time.Second, 100*time.Millisecond, "every message acked on the restarted server")
}
