package rabbit

import (
	"context"
	"fmt"
)

// Ping checks the publishing connection, dialling it again when it was lost
// (as the next publish would), and opens and closes a channel on it: a
// round trip the broker must answer.
func (b *Broker) Ping(ctx context.Context) error {
	conn, err := b.connection(ctx)
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("rabbitmq: open a channel on %s: %w", b.redacted, err)
	}
	return ch.Close()
}
