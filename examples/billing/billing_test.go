package billing_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
)

// A service like billing imports neither natsdev nor kafkadev, so it links
// neither the embedded nats-server nor kfake; a config that asks for one is
// refused when it loads, naming the YAML key and the package to import.
func TestDevBrokersNotLinked(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ yaml, want string }{
		{"broker:\n  kind: nats\n  nats:\n    url: nats://127.0.0.1:0\n    embedded:\n      enabled: true\n",
			`broker.nats.embedded.enabled: the embedded nats-server is not linked into this program: import _ "github.com/millrace-io/millrace/adapters/nats/natsdev"`},
		{"broker:\n  kind: kafka\n  kafka:\n    brokers: [127.0.0.1:0]\n    dev_cluster: true\n",
			`broker.kafka.dev_cluster: the in-process Kafka dev cluster is not linked into this program: import _ "github.com/millrace-io/millrace/adapters/kafka/kafkadev"`},
	} {
		_, err := bus.ParseConfig([]byte(tc.yaml))
		require.ErrorContains(t, err, tc.want)
	}
}
