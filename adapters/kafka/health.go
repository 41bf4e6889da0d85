package kafka

import (
	"context"
	"fmt"

	"github.com/millrace-io/millrace/adapters"
)

// Ping asks a broker of the cluster for its metadata.
func (b *Broker) Ping(ctx context.Context) error {
	if b.closed.Load() {
		return fmt.Errorf("kafka: %w", adapters.ErrClosed)
	}
	if err := b.client.Ping(ctx); err != nil {
		return fmt.Errorf("kafka: no broker answered: %w", err)
	}
	return nil
}
