package nats

import (
	"context"
	"fmt"

	"github.com/millrace-io/millrace/adapters"
)

var _ adapters.BacklogReporter = (*Broker)(nil)

// Backlog returns the group's JetStream consumer's NumPending on topic's
// stream: the messages not yet delivered to the group (those delivered and
// not acked yet are not counted).
func (b *Broker) Backlog(ctx context.Context, topic, consumerGroup string) (map[string]int64, error) {
	c, err := b.js.PushConsumer(ctx, StreamName(topic), ConsumerName(consumerGroup))
	if err != nil {
		return nil, fmt.Errorf("nats: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("nats: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	return map[string]int64{"": int64(info.NumPending)}, nil
}
