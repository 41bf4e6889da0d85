package kafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
)

// Backlog returns, per partition of topic, its high watermark minus the
// group's committed offset (the whole partition when the group committed
// nothing there); messages processed but not committed yet (see
// broker.kafka.commit_interval) still count. With retry topics, the
// partitions of the group's retry topic the group has committed in come
// too, as "retry-<partition>": messages parked for their next attempt.
func (b *Broker) Backlog(ctx context.Context, topic, consumerGroup string) (map[string]int64, error) {
	lags, err := b.admin.Lag(ctx, consumerGroup)
	if err != nil {
		return nil, fmt.Errorf("kafka: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	group, ok := lags[consumerGroup]
	if !ok {
		return nil, fmt.Errorf("kafka: backlog of group %q on topic %q: no answer for the group", consumerGroup, topic)
	}
	out := map[string]int64{}
	// A group that has neither members nor commits yet does not exist for
	// the cluster (GROUP_ID_NOT_FOUND): it is behind by all of topic.
	if err := group.Error(); err != nil && !errors.Is(err, kerr.GroupIDNotFound) {
		return nil, fmt.Errorf("kafka: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	for partition, l := range group.Lag[topic] {
		if l.Err != nil {
			if kerr.IsRetriable(l.Err) {
				// A leader moved (NOT_LEADER_FOR_PARTITION and friends):
				// kadm does not refresh the client's metadata on a
				// partition's error, so the next reading would ask the old
				// leader again until the metadata's max age.
				b.client.ForceMetadataRefresh()
			}
			return nil, fmt.Errorf("kafka: backlog of group %q on topic %q partition %d: %w", consumerGroup, topic, partition, l.Err)
		}
		out[strconv.Itoa(int(partition))] = l.Lag
	}
	// Messages parked for their next attempt are not processed either. Only
	// beside the topic's own partitions: without those the group has
	// committed nothing on topic, and the whole topic is its backlog below.
	if len(out) > 0 {
		for partition, l := range group.Lag[RetryTopicName(topic, consumerGroup)] {
			if l.Err == nil {
				out["retry-"+strconv.Itoa(int(partition))] = l.Lag
			}
		}
		return out, nil
	}
	starts, err := b.admin.ListStartOffsets(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("kafka: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	ends, err := b.admin.ListEndOffsets(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("kafka: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	if err := ends.Error(); err != nil {
		if kerr.IsRetriable(err) {
			b.client.ForceMetadataRefresh() // as above
		}
		return nil, fmt.Errorf("kafka: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	ends.Each(func(end kadm.ListedOffset) {
		start, _ := starts.Lookup(topic, end.Partition)
		out[strconv.Itoa(int(end.Partition))] = end.Offset - start.Offset
	})
	return out, nil
}
