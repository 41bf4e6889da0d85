package nats

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// Backlog returns the group's JetStream consumer's NumPending on topic's
// stream: the messages not yet delivered to the group (those delivered and
// not acked yet are not counted). An ordered group's consumer is missing
// for a moment while its ordered subscriber recreates it: Backlog then
// reports no partition rather than an error.
func (b *Broker) Backlog(ctx context.Context, topic, consumerGroup string) (map[string]int64, error) {
	c, err := b.js.PushConsumer(ctx, StreamName(topic), ConsumerName(consumerGroup))
	if errors.Is(err, jetstream.ErrConsumerNotFound) && b.isOrdered(topic, consumerGroup) {
		return map[string]int64{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("nats: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("nats: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	return map[string]int64{"": int64(info.NumPending)}, nil
}
