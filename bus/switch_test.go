package bus_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// switchNode is a service of one broker.kind on a shared outbox.
type switchNode struct {
	bus     *bus.Bus
	handled chan string
	done    chan error
	stop    context.CancelFunc
}

func startSwitchNode(t *testing.T, cfg bus.Config, topic string) *switchNode {
	t.Helper()
	ctx := context.Background()
	b, err := bus.Open(ctx, cfg, testdb.Open(t))
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	n := &switchNode{bus: b, handled: make(chan string, 10), done: make(chan error, 1)}
	require.NoError(t, b.Handle(topic, "switch-"+cfg.Broker.Kind, func(_ context.Context, ev bus.Event) error {
		n.handled <- ev.AggregateID
		return nil
	}))
	runCtx, stop := context.WithCancel(ctx)
	n.stop = stop
	go func() { n.done <- b.Run(runCtx) }()
	t.Cleanup(stop)
	return n
}

func (n *switchNode) publish(t *testing.T, topic, id string) {
	t.Helper()
	require.NoError(t, n.bus.PublishInOwnTx(context.Background(), topic, bus.Event{Type: "T", AggregateType: "a", AggregateID: id, Payload: []byte(`{}`)}))
}

// next returns the next event the node handled, failing the test when its
// Run ends first.
func (n *switchNode) next(t *testing.T) string {
	t.Helper()
	select {
	case id := <-n.handled:
		return id
	case err := <-n.done:
		t.Fatalf("Run ended: %v", err)
	case <-time.After(90 * time.Second):
		t.Fatal("no event handled in 90s")
	}
	return ""
}

func (n *switchNode) halt(t *testing.T) {
	t.Helper()
	n.stop()
	require.NoError(t, <-n.done)
}

// The outbox knows which broker.kind it is relayed to. A service of another
// kind is refused at Open while events for the recorded one are pending;
// the switch goes through once they are drained (stop the publishers, let
// the old relays drain, start the new kind): its relay records the new
// kind. A relay of one kind never forwards an event a service of another
// kind wrote: it stops, naming both, and the event waits for its own kind.
func TestSwitchingBrokersNeverMisroutes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Open(t)
	schema := testdb.Schema(t, db)
	topic := "switch-" + schema[len(schema)-8:]
	configs := map[string]bus.Config{}
	for _, kind := range []string{bus.KindNATS, bus.KindRabbitMQ} {
		var cfg bus.Config
		cfg.Database.Schema = schema
		brokertest.Apply(t, kind, &cfg)
		cfg.Relay.PollInterval = 100 * time.Millisecond
		configs[kind] = cfg
		brokertest.Cleanup(t, kind, topic, "switch-"+kind)
	}
	require.NoError(t, bus.Migrate(ctx, db, configs[bus.KindNATS]))

	nats := startSwitchNode(t, configs[bus.KindNATS], topic)
	nats.publish(t, topic, "n1")
	require.Equal(t, "n1", nats.next(t))
	nats.halt(t)
	nats.publish(t, topic, "n2") // pending: no relay runs

	_, err := bus.Open(ctx, configs[bus.KindRabbitMQ], db)
	require.ErrorIs(t, err, forwarder.ErrBrokerChanged)
	require.ErrorContains(t, err, `"nats"`)
	require.ErrorContains(t, err, `"rabbitmq"`)
	require.ErrorContains(t, err, "Switching brokers")

	nats = startSwitchNode(t, configs[bus.KindNATS], topic) // the old relay drains
	require.Equal(t, "n2", nats.next(t))
	nats.halt(t)

	rabbit := startSwitchNode(t, configs[bus.KindRabbitMQ], topic)
	rabbit.publish(t, topic, "r1")
	require.Equal(t, "r1", rabbit.next(t))

	nats.publish(t, topic, "n3") // a service still configured for NATS
	select {
	case err := <-rabbit.done:
		require.ErrorIs(t, err, forwarder.ErrBrokerChanged)
		require.ErrorContains(t, err, `written by a service with broker.kind "nats"`)
		require.ErrorContains(t, err, `this relay's broker.kind is "rabbitmq"`)
	case <-time.After(90 * time.Second):
		t.Fatal("the RabbitMQ relay forwarded or held an event written for NATS without a word")
	}
	select {
	case id := <-rabbit.handled:
		t.Fatalf("event %s written for NATS reached RabbitMQ", id)
	default:
	}
	nats = startSwitchNode(t, configs[bus.KindNATS], topic)
	require.Equal(t, "n3", nats.next(t), "the event waits for a relay of its kind")
}
