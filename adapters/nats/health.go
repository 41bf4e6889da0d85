package nats

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/millrace-io/millrace/adapters"
)

// Ping makes a round trip to the server on the publishing connection.
func (b *Broker) Ping(ctx context.Context) error {
	if b.isClosed() {
		return fmt.Errorf("nats: %w", adapters.ErrClosed)
	}
	if st := b.nc.Status(); st != nats.CONNECTED {
		return fmt.Errorf("nats: the connection to %s is %s", redact(b.url), st)
	}
	if err := b.nc.FlushWithContext(ctx); err != nil {
		return fmt.Errorf("nats: %s did not answer: %w", redact(b.url), err)
	}
	return nil
}
