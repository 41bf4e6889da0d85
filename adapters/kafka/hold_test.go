package kafka_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// TestHoldOutlastsRebalance: a member of a group holds a delivered message
// (as the circuit breaker does during an outage, until the message's context
// ends) while another member joins, for longer than the rebalance timeout.
// The held message's context ends with its session, so the member nacks it
// and rejoins in time, and every message is processed.
func TestHoldOutlastsRebalance(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	cfg := env.config()
	cfg.Partitions = 2
	cfg.SessionTimeout = 6 * time.Second // the least kfake (and Kafka) accept
	cfg.RebalanceTimeout = 2 * time.Second
	cfg.JoinWait = 2 * time.Second
	b := open(t, cfg)
	topic, group := adaptertest.Name("hold"), adaptertest.Name("g")

	const n = 40
	var msgs []*message.Message
	for i := range n {
		msgs = append(msgs, event(fmt.Sprintf("agg-%d", i%8), i))
	}
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)))

	var mu sync.Mutex
	processed := map[string]bool{}
	consume := func(ch <-chan *message.Message, hold func(*message.Message) bool) {
		for m := range ch {
			if hold != nil && !hold(m) {
				m.Nack()
				continue
			}
			mu.Lock()
			processed[m.UUID] = true
			mu.Unlock()
			m.Ack()
		}
	}

	held := make(chan struct{})
	endHold := make(chan struct{})
	released := make(chan error, 1)
	var once sync.Once
	// The first message is held until its context ends (then nacked, as
	// the breaker's shutdown is) or the hold ends (then processed).
	hold := func(m *message.Message) bool {
		first := false
		once.Do(func() { first = true })
		if !first {
			return true
		}
		close(held)
		select {
		case <-m.Context().Done():
			released <- context.Cause(m.Context())
			return false
		case <-endHold:
			return true
		}
	}
	go consume(adaptertest.Subscribe(t, b, topic, group), hold)

	select {
	case <-held:
	case <-time.After(30 * time.Second):
		require.FailNow(t, "no message was delivered")
	}
	go consume(adaptertest.Subscribe(t, b, topic, group), nil)
	// Hold well past the rebalance timeout the join starts.
	time.Sleep(3 * cfg.RebalanceTimeout)
	close(endHold)
	select {
	case cause := <-released:
		require.ErrorIs(t, cause, kafka.ErrRebalanced, "the held message's context ends with its session")
	default:
		require.FailNow(t, "the held message's context did not end when the group rebalanced")
	}

	testkit.Eventually(t, 60*time.Second, "every message is processed after the hold", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(processed) == n
	})
}
