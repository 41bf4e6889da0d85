package bus_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// With outbox.cloudevents on, every event reaches the broker with the
// CloudEvents binary-mode attributes as headers under the prefix of that
// broker's binding; a plain JetStream consumer, no millrace in it, reads
// them on NATS.
func TestCloudEventsAttributesReachTheBroker(t *testing.T) {
	t.Parallel()
	prefixes := map[string]string{bus.KindKafka: "ce_", bus.KindNATS: "ce-", bus.KindRabbitMQ: "cloudEvents_"}
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			svc := brokertest.NewService(t, kind, func(cfg *bus.Config) {
				cfg.Outbox.CloudEvents = bus.CloudEventsConfig{Enabled: true, Source: "/services/orders"}
			})
			cfg := svc.Config
			topic := "ce-" + testdb.UniqueName("")[2:]
			brokertest.Cleanup(t, kind, topic, "tap")
			b := svc.Open(t)
			prefix := prefixes[kind]

			ev := orderCreated("o-1")
			ev.ID = "evt-ce-1"
			ev.OccurredAt = time.Date(2026, 5, 6, 7, 8, 9, 10, time.UTC)
			refused := ev
			refused.Metadata = map[string]string{prefix + "subject": "mine"}
			err := b.PublishInOwnTx(ctx, topic, refused)
			require.ErrorIs(t, err, bus.ErrInvalidField)
			require.ErrorContains(t, err, "hold CloudEvents attributes")

			msgs := brokertest.Tap(t, cfg, topic, "tap")

			running := testkit.Start(t, b.Run)
			defer func() { require.NoError(t, running.Stop(t, time.Minute)) }()
			require.NoError(t, b.PublishInOwnTx(ctx, topic, ev))

			want := map[string]string{
				prefix + "id": "evt-ce-1", prefix + "type": "OrderCreated", prefix + "source": "/services/orders",
				prefix + "specversion": "1.0", prefix + "time": "2026-05-06T07:08:09.00000001Z",
				"content-type": "application/json",
			}
			select {
			case m := <-msgs:
				for k, v := range want {
					require.Equal(t, v, m.Metadata.Get(k), "%s header %s", kind, k)
				}
				m.Ack()
			case <-time.After(60 * time.Second):
				t.Fatalf("%s: the event did not arrive", kind)
			}

			if kind == bus.KindNATS {
				js := brokertest.NATSJetStream(t, cfg.Broker.NATS.URL)
				stream, err := js.Stream(ctx, nats.StreamName(topic))
				require.NoError(t, err)
				raw, err := stream.GetMsg(ctx, 1)
				require.NoError(t, err)
				for k, v := range want {
					require.Equal(t, v, raw.Header.Get(k), "NATS header %s as a plain client reads it", k)
				}
			}
		})
	}
}

// outbox.cloudevents.source is required when CloudEvents are on, and
// pointless when they are off.
func TestCloudEventsConfig(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		yaml, want string
	}{
		{"outbox:\n  cloudevents:\n    enabled: true\n", "outbox.cloudevents.source: required when outbox.cloudevents.enabled is true"},
		{"outbox:\n  cloudevents:\n    enabled: true\n    source: \"a b\"\n", `outbox.cloudevents.source: must be a URI reference`},
		{"outbox:\n  cloudevents:\n    source: /services/orders\n", "outbox.cloudevents.source: set while outbox.cloudevents.enabled is false"},
	} {
		_, err := bus.ParseConfig([]byte(c.yaml))
		require.ErrorContains(t, err, c.want)
	}
	cfg, err := bus.ParseConfig([]byte("outbox:\n  cloudevents:\n    enabled: true\n    source: urn:example:orders\n"))
	require.NoError(t, err)
	require.Equal(t, "urn:example:orders", cfg.Outbox.CloudEvents.Source)
}
