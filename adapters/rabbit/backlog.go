package rabbit

import (
	"context"
	"fmt"
)

// Backlog returns the ready messages of the group's queue on topic (a
// passive declare: a missing queue is an error); messages delivered and
// not acked yet are not counted.
func (b *Broker) Backlog(ctx context.Context, topic, consumerGroup string) (map[string]int64, error) {
	conn, err := b.connection(ctx)
	if err != nil {
		return nil, err
	}
	defer b.dropOnCancel(ctx, conn)()
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: open channel on %s: %w", b.redacted, err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(QueueName(topic, consumerGroup), true, false, false, false, nil)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: backlog of group %q on topic %q: %w", consumerGroup, topic, err)
	}
	return map[string]int64{"": int64(q.Messages)}, nil
}
