package kafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"

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
// Consumer groups need no provisioning in Kafka: a group exists once a
// consumer joins it, and a new group starts at the oldest record. Their
// names are checked.
func (b *Broker) Provision(ctx context.Context, topic string, consumerGroups ...string) error {
	if err := names.Topic(topic); err != nil {
		return fmt.Errorf("kafka: topic %q: %w", topic, err)
	}
	for _, g := range consumerGroups {
		if err := names.Topic(g); err != nil {
			return fmt.Errorf("kafka: consumer group %q: %w", g, err)
		}
	}
	if b.closed.Load() {
		return ErrClosed
	}
	err := withContext(ctx, func() error {
		md, err := b.describeTopic(topic)
		if err != nil {
			return err
		}
		if md == nil {
			if md, err = b.createTopic(topic); err != nil || md == nil {
				return err
			}
		}
		return b.checkTopic(topic, md)
	})
	if err != nil {
		return err
	}
	b.provisioned.Store(topic, true)
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
	err := withContext(ctx, func() error {
		md, err := b.describeTopic(topic)
		if err == nil && md == nil {
			_, err = b.createTopic(topic)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("kafka: cannot make sure topic %s exists: %w", topic, err)
	}
	b.provisioned.Store(topic, true)
	return nil
}

// describeTopic returns topic's metadata, or nil when it does not exist.
func (b *Broker) describeTopic(topic string) (*sarama.TopicMetadata, error) {
	mds, err := b.admin.DescribeTopics([]string{topic})
	if err != nil {
		return nil, fmt.Errorf("kafka: cannot describe topic %s: %w", topic, err)
	}
	for _, md := range mds {
		if md.Name != topic {
			continue
		}
		switch {
		case errors.Is(md.Err, sarama.ErrUnknownTopicOrPartition):
			return nil, nil
		case md.Err != sarama.ErrNoError:
			return nil, fmt.Errorf("kafka: cannot describe topic %s: %w", topic, md.Err)
		}
		return md, nil
	}
	return nil, nil
}

// createTopic creates topic with the configured settings and returns its
// metadata (nil if the cluster does not show it yet).
func (b *Broker) createTopic(topic string) (*sarama.TopicMetadata, error) {
	minISR := strconv.Itoa(b.cfg.MinInsyncReplicas)
	detail := &sarama.TopicDetail{
		NumPartitions:     int32(b.cfg.Partitions),
		ReplicationFactor: int16(b.cfg.ReplicationFactor),
		ConfigEntries:     map[string]*string{"min.insync.replicas": &minISR},
	}
	err := b.admin.CreateTopic(topic, detail, false)
	switch {
	case err == nil:
		b.logger.Info("Created Kafka topic", watermill.LogFields{
			"topic": topic, "partitions": b.cfg.Partitions, "replication_factor": b.cfg.ReplicationFactor,
		})
	case errors.Is(err, sarama.ErrTopicAlreadyExists): // created concurrently elsewhere
	case errors.Is(err, sarama.ErrInvalidReplicationFactor):
		return nil, fmt.Errorf("kafka: cannot create topic %s with replication factor %d (broker.kafka.replication_factor): the cluster has fewer brokers: %w",
			topic, b.cfg.ReplicationFactor, err)
	default:
		return nil, fmt.Errorf("kafka: cannot create topic %s: %w", topic, err)
	}
	return b.describeTopic(topic)
}

// checkTopic compares an existing topic with the configuration.
func (b *Broker) checkTopic(topic string, md *sarama.TopicMetadata) error {
	var diffs []error
	if n := len(md.Partitions); n != b.cfg.Partitions {
		diffs = append(diffs, fmt.Errorf(
			"it has %d partitions, broker.kafka.partitions is %d (set partitions: %d to use the topic as it is; changing a topic's partition count moves aggregates to other partitions)",
			n, b.cfg.Partitions, n))
	}
	replicas := -1
	for _, p := range md.Partitions {
		if replicas < 0 || len(p.Replicas) < replicas {
			replicas = len(p.Replicas)
		}
	}
	if replicas >= 0 && replicas < b.cfg.ReplicationFactor {
		diffs = append(diffs, fmt.Errorf("it has replication factor %d, less than broker.kafka.replication_factor %d",
			replicas, b.cfg.ReplicationFactor))
	}
	entries, err := b.admin.DescribeConfig(sarama.ConfigResource{
		Type:        sarama.TopicResource,
		Name:        topic,
		ConfigNames: []string{"min.insync.replicas", "max.message.bytes"},
	})
	if err != nil {
		return fmt.Errorf("kafka: cannot read the config of topic %s: %w", topic, err)
	}
	for _, e := range entries {
		n, err := strconv.Atoi(e.Value)
		if err != nil {
			continue
		}
		switch e.Name {
		case "min.insync.replicas":
			if n < b.cfg.MinInsyncReplicas {
				diffs = append(diffs, fmt.Errorf("its min.insync.replicas is %d, less than broker.kafka.min_insync_replicas %d",
					n, b.cfg.MinInsyncReplicas))
			}
		case "max.message.bytes":
			if n < b.cfg.MaxMessageBytes {
				diffs = append(diffs, fmt.Errorf(
					"its max.message.bytes is %d, less than broker.kafka.max_message_bytes %d (lower max_message_bytes or raise the topic's max.message.bytes)",
					n, b.cfg.MaxMessageBytes))
			}
		}
	}
	if len(diffs) > 0 {
		return fmt.Errorf("kafka: existing topic %s conflicts with the configuration: %w", topic, errors.Join(diffs...))
	}
	return nil
}

// topicMaxMessageBytes reads the topic's effective max.message.bytes.
func (b *Broker) topicMaxMessageBytes(topic string) (int, error) {
	entries, err := b.admin.DescribeConfig(sarama.ConfigResource{
		Type: sarama.TopicResource, Name: topic, ConfigNames: []string{"max.message.bytes"},
	})
	if err != nil {
		return 0, err
	}
	for _, e := range entries {
		if e.Name == "max.message.bytes" {
			return strconv.Atoi(e.Value)
		}
	}
	return 0, errors.New("max.message.bytes not reported")
}

// withContext runs fn, returning early when ctx ends. Sarama's admin calls
// take no context; fn still finishes in the background, bounded by Sarama's
// own timeouts.
func withContext(ctx context.Context, fn func() error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}
