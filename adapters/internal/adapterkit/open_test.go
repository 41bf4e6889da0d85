package adapterkit_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/adapters/rabbit"
)

// opener opens one adapter with the address given, or with an invalid
// section when address is "".
type opener struct {
	kind string
	open func(t *testing.T, address string, opts adapters.Options) error
}

var openers = []opener{
	{kafka.Kind, func(t *testing.T, address string, opts adapters.Options) error {
		cfg := kafka.Config{Brokers: []string{address}}
		if address == "" {
			cfg.Partitions = -1
		}
		b, err := kafka.Open(t.Context(), cfg, opts)
		if err == nil {
			_ = b.Close()
		}
		return err
	}},
	{nats.Kind, func(t *testing.T, address string, opts adapters.Options) error {
		b, err := nats.Open(t.Context(), nats.Config{URL: "nats://" + address}, opts)
		if err == nil {
			_ = b.Close()
		}
		return err
	}},
	{rabbit.Kind, func(t *testing.T, address string, opts adapters.Options) error {
		b, err := rabbit.Open(t.Context(), rabbit.Config{URL: "amqp://" + address + "/"}, opts)
		if err == nil {
			_ = b.Close()
		}
		return err
	}},
}

// The three adapters' Open read the same: an invalid section is
// "<kind>: invalid config: broker.<kind>...", a broker that does not answer
// "<kind>: cannot connect to <address>: ...".
func TestOpenErrorsReadTheSame(t *testing.T) {
	t.Parallel()
	for _, o := range openers {
		t.Run(o.kind, func(t *testing.T) {
			t.Parallel()
			opts := adapters.Options{ConnectTimeout: 500 * time.Millisecond}
			err := o.open(t, "", opts)
			require.Error(t, err)
			require.Regexp(t, "^"+o.kind+`: invalid config: broker\.`+o.kind+`\.`, err.Error())

			err = o.open(t, "127.0.0.1:1", opts)
			require.Error(t, err)
			require.Regexp(t, "^"+o.kind+`: cannot connect to .*127\.0\.0\.1:1\D`, err.Error())
		})
	}
}
