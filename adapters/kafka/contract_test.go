package kafka_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// TestContract runs millrace's adapter suite. On a dev cluster the restart
// test stops the cluster and starts it again on the same ports with the same
// data directory (topics, records, committed offsets and producer state are
// kept); against a real cluster (KAFKA_BROKERS) it is skipped, as the test
// cannot restart that.
func TestContract(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	cfg := env.config()
	h := adaptertest.Harness{
		NewBroker: func(t *testing.T) adapters.Broker {
			b, err := kafka.Open(context.Background(), cfg, adapters.Options{ConnectTimeout: 30 * time.Second})
			require.NoError(t, err)
			return b
		},
		MaxMessageBytes: kafka.DefaultMaxMessageBytes,
	}
	if env.restartable() {
		h.RestartBroker = env.restart
	}
	adaptertest.Run(t, h)
}

// Watermill's universal suite, in two honest configurations. Neither can run
// TestReconnect: it needs a shell command that restarts the broker, and the
// dev cluster lives in this process (TestContract's restart test and
// TestBrokerOutage cover reconnecting instead).

// TestWatermillSharedGroup: every Subscriber a test makes joins the same
// consumer group (as watermill-kafka's own tests use one group), on topics
// with the default partition count. Subscribers of one test compete for
// partitions, and a new subscriber continues from the group's committed
// offsets. Order holds only per partition, and the suite's messages carry
// no aggregate id (so no key), hence GuaranteedOrder is false.
func TestWatermillSharedGroup(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	cfg := env.config()
	tests.TestPubSub(t, tests.Features{
		ConsumerGroups:      true,
		ExactlyOnceDelivery: false,
		GuaranteedOrder:     false,
		Persistent:          true,
		ForceShort:          true,
	}, func(t *testing.T) (message.Publisher, message.Subscriber) {
		return pubSub(t, cfg, groupOf(t))
	}, func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		return pubSub(t, cfg, group)
	})
}

// TestWatermillNewGroupPerSubscriber: every Subscriber is a new consumer
// group, on single-partition topics. A new group starts at the oldest
// record, so it receives messages published before it existed
// (NewSubscriberReceivesOldMessages), and one partition is one ordered log
// (GuaranteedOrder: the order Kafka guarantees per partition, which millrace
// uses per aggregate id).
func TestWatermillNewGroupPerSubscriber(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	cfg := env.config()
	cfg.Partitions = 1
	tests.TestPubSub(t, tests.Features{
		ConsumerGroups:                   true,
		ExactlyOnceDelivery:              false,
		GuaranteedOrder:                  true,
		Persistent:                       true,
		NewSubscriberReceivesOldMessages: true,
		ForceShort:                       true,
	}, func(t *testing.T) (message.Publisher, message.Subscriber) {
		return pubSub(t, cfg, adaptertest.Name("g"))
	}, func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		return pubSub(t, cfg, group)
	})
}

// pubSub opens a Broker for one constructor call of the suite.
func pubSub(t *testing.T, cfg kafka.Config, group string) (message.Publisher, message.Subscriber) {
	b := open(t, cfg)
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	return b.Publisher(), sub
}

// groupOf names the consumer group of one suite test: the same for every
// constructor call within the test, different between tests.
func groupOf(t *testing.T) string {
	sum := sha256.Sum256([]byte(t.Name()))
	return "g-" + hex.EncodeToString(sum[:8])
}
