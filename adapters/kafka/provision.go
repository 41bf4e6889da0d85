package kafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/names"
)

// Provision makes topic exist with broker.kafka's partitions, replication
// factor and min.insync.replicas, idempotently. For an existing topic it
// checks that it matches: a different partition count, or a replication
// factor, min.insync.replicas or max.message.bytes weaker than configured,
// is an error saying what differs.
//
// A partition count that differs is an error rather than a warning because
// it changes which partition each aggregate's events go to: a topic with
// more partitions than configured means the config describes another
// topic, and growing a topic moves keys to other partitions, breaking
// per-aggregate order while old events are still being consumed. Fix it
// explicitly: set broker.kafka.partitions to the topic's count.
//
// A Kafka consumer group exists once it has committed offsets: Provision
// commits, for each of consumerGroups, the oldest offset of every partition
// of topic on which the group has committed none, so that the group starts
// at the oldest record (ProvisionGroup can start it at the newest instead)
// and keeps that start however long before its first consumer joins.
// Partitions the group committed on keep their position. With
// broker.kafka.retry_topics each group gets its retry topic
// (RetryTopicName), provisioned as topic is.
func (b *Broker) Provision(ctx context.Context, topic string, consumerGroups ...string) error {
	return b.provision(ctx, topic, adapters.StartAll, consumerGroups...)
}

// ProvisionGroup is Provision for one group, which starts, on each partition
// of topic where it has committed no offset, at group.Start: the partition's
// end (adapters.StartNew: it reads what is published from then on) or its
// oldest record (adapters.StartAll). Kafka keeps a group's order across
// redeliveries without settings of its own, so group.Ordered changes
// nothing. See adapters.Broker.
func (b *Broker) ProvisionGroup(ctx context.Context, topic string, group adapters.GroupSpec) error {
	return b.provision(ctx, topic, group.Start, group.Name)
}

// provision is Provision, with new groups starting at start.
func (b *Broker) provision(ctx context.Context, topic string, start adapters.Start, consumerGroups ...string) error {
	if err := names.Topic(topic); err != nil {
		return adapters.Permanent(fmt.Errorf("kafka: topic %q: %w", topic, err))
	}
	for _, g := range consumerGroups {
		if err := names.Topic(g); err != nil {
			return adapters.Permanent(fmt.Errorf("kafka: consumer group %q: %w", g, err))
		}
	}
	if b.closed.Load() {
		return errClosed
	}
	info, err := b.describeTopic(ctx, topic)
	if err != nil {
		return err
	}
	if info == nil {
		if info, err = b.createTopic(ctx, topic); err != nil {
			return err
		}
	}
	if info != nil {
		if err := b.checkTopic(ctx, topic, info); err != nil {
			return err
		}
	}
	b.provisioned.Store(topic, true)
	for _, g := range consumerGroups {
		if b.cfg.RetryTopics {
			if err := b.Provision(ctx, RetryTopicName(topic, g)); err != nil {
				return err
			}
		}
		if err := b.startGroup(ctx, topic, g, start); err != nil {
			return err
		}
	}
	return nil
}

// startGroup commits group's offset at start (the end or the oldest record)
// on every partition of topic on which it has committed none. The commit is
// a simple one, as for a group without members; a group that has members
// is not new, and keeps their position.
func (b *Broker) startGroup(ctx context.Context, topic, group string, start adapters.Start) error {
	committed, err := b.admin.FetchOffsetsForTopics(ctx, group, topic)
	if err == nil {
		err = committed.Error()
	}
	if errors.Is(err, kerr.GroupIDNotFound) {
		committed, err = nil, nil // a group that never committed (kfake says so; Kafka lists no offsets)
	}
	if err != nil {
		return fmt.Errorf("kafka: read the committed offsets of consumer group %q on topic %s: %w", group, topic, err)
	}
	list := b.admin.ListStartOffsets
	if start == adapters.StartNew {
		list = b.admin.ListEndOffsets
	}
	listed, err := list(ctx, topic)
	if err == nil {
		err = listed.Error()
	}
	if err != nil {
		return fmt.Errorf("kafka: read the offsets of topic %s: %w", topic, err)
	}
	offsets := kadm.Offsets{}
	listed.Each(func(l kadm.ListedOffset) {
		if o, ok := committed.Lookup(topic, l.Partition); !ok || o.At < 0 {
			offsets.Add(kadm.Offset{Topic: topic, Partition: l.Partition, At: l.Offset, LeaderEpoch: -1})
		}
	})
	if len(offsets) == 0 {
		return nil
	}
	resps, err := b.admin.CommitOffsets(ctx, group, offsets)
	if err == nil {
		err = resps.Error()
	}
	switch {
	case err == nil:
		b.logger.Info("Consumer group created", watermill.LogFields{"topic": topic, "consumer_group": group, "start": string(start)})
		return nil
	case errors.Is(err, kerr.UnknownMemberID), errors.Is(err, kerr.IllegalGeneration), errors.Is(err, kerr.RebalanceInProgress):
		return nil // the group has members: it is not new, and their position stands
	}
	return fmt.Errorf("kafka: start consumer group %q on topic %s at %s: %w", group, topic, start, err)
}

// Deprovision deletes topic, with its records, and consumerGroups' committed
// offsets and retry topics. A topic or group already gone is not an error; a group with
// live members is. See adapters.Broker.
func (b *Broker) Deprovision(ctx context.Context, topic string, consumerGroups ...string) error {
	if err := names.Topic(topic); err != nil {
		return adapters.Permanent(fmt.Errorf("kafka: topic %q: %w", topic, err))
	}
	if b.closed.Load() {
		return errClosed
	}
	b.provisioned.Delete(topic)
	topics, err := b.admin.DeleteTopics(ctx, topic)
	if err != nil {
		return fmt.Errorf("kafka: delete topic %q: %w", topic, err)
	}
	if r, ok := topics[topic]; ok && r.Err != nil && !errors.Is(r.Err, kerr.UnknownTopicOrPartition) {
		return fmt.Errorf("kafka: delete topic %q: %w", topic, r.Err)
	}
	b.client.PurgeTopicsFromClient(topic) // a topic created again gets a new id
	if len(consumerGroups) == 0 {
		return nil
	}
	for _, g := range consumerGroups {
		if err := b.Deprovision(ctx, RetryTopicName(topic, g)); err != nil {
			return err
		}
	}
	groups, err := b.admin.DeleteGroups(ctx, consumerGroups...)
	if err != nil {
		return fmt.Errorf("kafka: delete consumer groups of topic %q: %w", topic, err)
	}
	for _, g := range consumerGroups {
		if r, ok := groups[g]; ok && r.Err != nil && !errors.Is(r.Err, kerr.GroupIDNotFound) {
			return fmt.Errorf("kafka: delete consumer group %q: %w", g, r.Err)
		}
	}
	return nil
}

// ensureTopic makes sure topic exists before its first publish or subscribe
// (broker.kafka.auto_provision): it creates a missing topic with the
// configured settings, and does not check an existing one (Provision does).
func (b *Broker) ensureTopic(ctx context.Context, topic string) error {
	if err := names.Topic(topic); err != nil {
		return adapters.Permanent(fmt.Errorf("kafka: topic %q: %w", topic, err))
	}
	if _, ok := b.provisioned.Load(topic); ok || !*b.cfg.AutoProvision {
		return nil
	}
	// One topic at a time: concurrent first publishes ask the broker once.
	b.provisionMu.Lock()
	defer b.provisionMu.Unlock()
	if _, ok := b.provisioned.Load(topic); ok {
		return nil
	}
	info, err := b.describeTopic(ctx, topic)
	if err == nil && info == nil {
		_, err = b.createTopic(ctx, topic)
	}
	if err != nil {
		return fmt.Errorf("kafka: cannot make sure topic %s exists: %w", topic, err)
	}
	b.provisioned.Store(topic, true)
	return nil
}

// topicInfo is what Provision checks of an existing topic.
type topicInfo struct {
	partitions  int
	minReplicas int // the fewest replicas of any partition
}

// describeTopic returns topic's partitions, or nil when it does not exist.
// It asks the cluster each time: the client's metadata cache could still
// hold a topic that was just created or deleted.
func (b *Broker) describeTopic(ctx context.Context, topic string) (*topicInfo, error) {
	req := kmsg.NewPtrMetadataRequest()
	rt := kmsg.NewMetadataRequestTopic()
	rt.Topic = kmsg.StringPtr(topic)
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, b.client)
	if err != nil {
		return nil, fmt.Errorf("kafka: cannot describe topic %s: %w", topic, err)
	}
	for _, t := range resp.Topics {
		if t.Topic == nil || *t.Topic != topic {
			continue
		}
		switch err := kerr.ErrorForCode(t.ErrorCode); {
		case errors.Is(err, kerr.UnknownTopicOrPartition):
			return nil, nil
		case err != nil:
			return nil, fmt.Errorf("kafka: cannot describe topic %s: %w", topic, err)
		}
		info := &topicInfo{partitions: len(t.Partitions), minReplicas: -1}
		for _, p := range t.Partitions {
			if info.minReplicas < 0 || len(p.Replicas) < info.minReplicas {
				info.minReplicas = len(p.Replicas)
			}
		}
		return info, nil
	}
	return nil, nil
}

// createTopic creates topic with the configured settings and returns what
// the cluster shows of it (nil if it does not show it yet).
func (b *Broker) createTopic(ctx context.Context, topic string) (*topicInfo, error) {
	minISR := strconv.Itoa(b.cfg.MinInsyncReplicas)
	resp, err := b.admin.CreateTopic(ctx, int32(b.cfg.Partitions), int16(b.cfg.ReplicationFactor),
		map[string]*string{"min.insync.replicas": &minISR}, topic)
	if err == nil {
		err = resp.Err
	}
	switch {
	case err == nil:
		b.logger.Info("Created Kafka topic", watermill.LogFields{
			"topic": topic, "partitions": b.cfg.Partitions, "replication_factor": b.cfg.ReplicationFactor,
		})
	case errors.Is(err, kerr.TopicAlreadyExists): // created concurrently elsewhere
	case errors.Is(err, kerr.InvalidReplicationFactor):
		return nil, fmt.Errorf("kafka: cannot create topic %s with replication factor %d (broker.kafka.replication_factor): the cluster has fewer brokers: %w",
			topic, b.cfg.ReplicationFactor, err)
	default:
		return nil, fmt.Errorf("kafka: cannot create topic %s: %w", topic, err)
	}
	return b.describeTopic(ctx, topic)
}

// checkTopic compares an existing topic with the configuration.
func (b *Broker) checkTopic(ctx context.Context, topic string, info *topicInfo) error {
	var diffs []error
	if info.partitions != b.cfg.Partitions {
		diffs = append(diffs, fmt.Errorf(
			"it has %d partitions, broker.kafka.partitions is %d (set partitions: %d to use the topic as it is; changing a topic's partition count moves aggregates to other partitions)",
			info.partitions, b.cfg.Partitions, info.partitions))
	}
	if info.minReplicas >= 0 && info.minReplicas < b.cfg.ReplicationFactor {
		diffs = append(diffs, fmt.Errorf("it has replication factor %d, less than broker.kafka.replication_factor %d",
			info.minReplicas, b.cfg.ReplicationFactor))
	}
	configs, err := b.topicConfigs(ctx, topic)
	if err != nil {
		return fmt.Errorf("kafka: cannot read the config of topic %s: %w", topic, err)
	}
	if n, ok := configs["min.insync.replicas"]; ok && n < b.cfg.MinInsyncReplicas {
		diffs = append(diffs, fmt.Errorf("its min.insync.replicas is %d, less than broker.kafka.min_insync_replicas %d",
			n, b.cfg.MinInsyncReplicas))
	}
	if n, ok := configs["max.message.bytes"]; ok && n < b.cfg.MaxMessageBytes {
		diffs = append(diffs, fmt.Errorf(
			"its max.message.bytes is %d, less than broker.kafka.max_message_bytes %d (lower max_message_bytes or raise the topic's max.message.bytes)",
			n, b.cfg.MaxMessageBytes))
	}
	if len(diffs) > 0 {
		return fmt.Errorf("kafka: existing topic %s conflicts with the configuration: %w: %w", topic, adapters.ErrTopologyConflict, errors.Join(diffs...))
	}
	return nil
}

// topicConfigs reads the topic's effective min.insync.replicas and
// max.message.bytes.
func (b *Broker) topicConfigs(ctx context.Context, topic string) (map[string]int, error) {
	rcs, err := b.admin.DescribeTopicConfigs(ctx, topic)
	if err != nil {
		return nil, err
	}
	rc, err := rcs.On(topic, nil)
	if err == nil {
		err = rc.Err
	}
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, c := range rc.Configs {
		if c.Key != "min.insync.replicas" && c.Key != "max.message.bytes" {
			continue
		}
		if n, err := strconv.Atoi(c.MaybeValue()); err == nil {
			out[c.Key] = n
		}
	}
	return out, nil
}

// topicMaxMessageBytes reads the topic's effective max.message.bytes.
func (b *Broker) topicMaxMessageBytes(ctx context.Context, topic string) (int, error) {
	configs, err := b.topicConfigs(ctx, topic)
	if err != nil {
		return 0, err
	}
	n, ok := configs["max.message.bytes"]
	if !ok {
		return 0, errors.New("max.message.bytes not reported")
	}
	return n, nil
}
