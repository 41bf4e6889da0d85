package kafkadev_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// A member that dies while its join is pending (a consumer SIGKILLed as its
// group forms) must not keep partitions: Kafka expires it after its session
// timeout, and so must the dev cluster.
func TestMemberThatDiesMidJoinIsExpired(t *testing.T) {
	t.Parallel()
	dev, err := kafkadev.Start(kafkadev.Options{Brokers: 1})
	require.NoError(t, err)
	t.Cleanup(dev.Close)
	ctx := context.Background()
	const group, topic, partitions = "expire-group", "expire-topic", 4

	admin, err := kgo.NewClient(kgo.SeedBrokers(dev.Addrs()...))
	require.NoError(t, err)
	t.Cleanup(admin.Close)
	adm := kadm.NewClient(admin)
	_, err = adm.CreateTopic(ctx, partitions, 1, nil, topic)
	require.NoError(t, err)

	// The live member: it heartbeats every 3s, so it learns of a rebalance
	// up to 3s after it began.
	live, err := kgo.NewClient(kgo.SeedBrokers(dev.Addrs()...), kgo.ConsumerGroup(group), kgo.ConsumeTopics(topic),
		kgo.Balancers(kgo.RangeBalancer()), kgo.HeartbeatInterval(3*time.Second), kgo.SessionTimeout(10*time.Second))
	require.NoError(t, err)
	t.Cleanup(live.Close)
	go func() {
		for ctx.Err() == nil && !live.PollFetches(ctx).IsClientClosed() {
		}
	}()
	members := func() []string {
		described, err := adm.DescribeGroups(ctx, group)
		if err != nil {
			return nil
		}
		g := described[group]
		if g.State != "Stable" {
			return nil
		}
		var ids []string
		for _, m := range g.Members {
			ids = append(ids, m.MemberID)
		}
		return ids
	}
	testkit.Eventually(t, 30*time.Second, "the live member to hold the group", func() bool { return len(members()) == 1 })
	liveID := members()[0]

	// The dying member joins and its process goes away before the group
	// answers: the answer waits for the live member's next heartbeat.
	dying, err := kgo.NewClient(kgo.SeedBrokers(dev.Addrs()...))
	require.NoError(t, err)
	join := kmsg.NewPtrJoinGroupRequest()
	join.Group, join.ProtocolType = group, "consumer"
	join.SessionTimeoutMillis, join.RebalanceTimeoutMillis = 6000, 10000 // kfake's smallest session timeout
	meta := kmsg.NewConsumerMemberMetadata()
	meta.Topics = []string{topic}
	protocol := kmsg.NewJoinGroupRequestProtocol()
	protocol.Name, protocol.Metadata = "range", meta.AppendTo(nil)
	join.Protocols = append(join.Protocols, protocol)
	first, err := join.RequestWith(ctx, dying)
	require.NoError(t, err)
	require.ErrorIs(t, kerr.ErrorForCode(first.ErrorCode), kerr.MemberIDRequired)
	join.MemberID = first.MemberID
	pending := make(chan struct{})
	go func() {
		defer close(pending)
		_, _ = join.RequestWith(ctx, dying) // fails once the client closes
	}()
	time.Sleep(200 * time.Millisecond)
	dying.Close()
	<-pending

	testkit.Eventually(t, 30*time.Second, "the group to settle with the dying member in it", func() bool {
		return slices.Contains(members(), first.MemberID) && slices.Contains(members(), liveID)
	})
	testkit.Eventually(t, 30*time.Second, "the dead member to be expired and the live one to hold every partition", func() bool {
		described, err := adm.DescribeGroups(ctx, group)
		if err != nil || described[group].State != "Stable" || len(described[group].Members) != 1 {
			return false
		}
		assigned, ok := described[group].Members[0].Assigned.AsConsumer()
		return ok && len(assigned.Topics) == 1 && len(assigned.Topics[0].Partitions) == partitions
	})
}
