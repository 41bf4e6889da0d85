package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// TestContract runs millrace's adapter suite. On a dev cluster the restart
// test stops the cluster and starts it again on the same ports with the same
// data directory (topics, records, committed offsets and producer state are
// kept); against a real cluster (KAFKA_BROKERS) it is skipped, as the test
// cannot restart that.
func TestContract(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	cfg := env.config()
	h := adaptertest.Harness{
		NewBroker: func(t *testing.T) adapters.Broker {
			b, err := kafka.Open(context.Background(), cfg, adapters.Options{ConnectTimeout: 30 * time.Second})
			require.NoError(t, err)
			return b
		},
		MaxMessageBytes: kafka.DefaultMaxMessageBytes,
	}
	if env.restartable() {
		h.RestartBroker = env.restart
	}
	adaptertest.Run(t, h)
}
