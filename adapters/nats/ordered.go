package nats

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace-io/millrace/adapters"
)

// orderedMaxAckPending is the max_ack_pending of an ordered group's
// consumer: with one message delivered and unacked the server sends nothing
// newer, so a message a consumer held when it crashed, stopped or nacked is
// delivered again before anything published after it.
const orderedMaxAckPending = 1

var _ adapters.OrderedProvisioner = (*Broker)(nil)

// ProvisionOrdered is Provision for consumer groups whose handler keeps
// per-aggregate order (consumer.ordered: true). Their durable consumers get
// max_ack_pending 1 whatever broker.nats.consumer.max_ack_pending says: the
// group then has one message delivered at a time across all its
// subscriptions and processes, and a redelivery (after ack_wait for a
// consumer that crashed, after nak_delay for a nacked message) comes before
// every newer message. An existing consumer of the group with a higher
// max_ack_pending, made before the handler was ordered, is updated in place
// (JetStream allows editing it; lowering it reorders and loses nothing).
// The Broker remembers the groups: its later Provision and Subscribe calls
// for them keep max_ack_pending 1.
func (b *Broker) ProvisionOrdered(ctx context.Context, topic string, consumerGroups ...string) error {
	if err := checkTopic(topic); err != nil {
		return adapters.Permanent(err)
	}
	for _, g := range consumerGroups {
		if err := checkGroup(g); err != nil {
			return adapters.Permanent(err)
		}
	}
	b.mu.Lock()
	for _, g := range consumerGroups {
		key := topic + "\x00" + g
		if !b.ordered[key] {
			b.ordered[key] = true
			delete(b.consumers, key) // known to match the unordered settings only
		}
	}
	b.mu.Unlock()
	return b.Provision(ctx, topic, consumerGroups...)
}

// maxAckPending is the max_ack_pending of group's consumer on topic.
func (b *Broker) maxAckPending(topic, group string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ordered[topic+"\x00"+group] {
		return orderedMaxAckPending
	}
	return b.cfg.Consumer.MaxAckPending
}

// keepOrder lowers the max_ack_pending of an ordered group's existing
// consumer c to 1 when it is higher, keeping every other setting, and
// returns the consumer as the server has it then. Other consumers are left
// alone (a difference is then reported as a conflict).
func (b *Broker) keepOrder(ctx context.Context, topic, group string, c jetstream.PushConsumer) (jetstream.PushConsumer, error) {
	got := c.CachedInfo().Config
	if b.maxAckPending(topic, group) != orderedMaxAckPending || got.MaxAckPending <= orderedMaxAckPending {
		return c, nil
	}
	was := got.MaxAckPending
	got.MaxAckPending = orderedMaxAckPending
	updated, err := b.js.UpdatePushConsumer(ctx, StreamName(topic), got)
	if err != nil {
		return nil, fmt.Errorf("nats: lowering max_ack_pending of consumer %q on stream %q (group %q, topic %q) from %d to %d for an ordered handler: %w",
			got.Durable, StreamName(topic), group, topic, was, orderedMaxAckPending, err)
	}
	b.logger.Info("Lowered an ordered group's consumer to max_ack_pending 1", watermill.LogFields{
		"consumer": got.Durable, "stream": StreamName(topic), "was": was,
	})
	return updated, nil
}
