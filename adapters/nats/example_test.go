package nats_test

import (
	"context"
	"fmt"
	"os"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/nats"
	_ "github.com/millrace-io/millrace/adapters/nats/natsdev" // broker.nats.embedded needs it linked
)

// Open with an in-process server, provision a topic and its consumer
// group, publish a batch the way the relay does, and consume it.
func ExampleOpen() {
	ctx := context.Background()
	storeDir, _ := os.MkdirTemp("", "millrace-example")
	defer os.RemoveAll(storeDir)

	b, err := nats.Open(ctx, nats.Config{
		URL: "nats://127.0.0.1:0", // with embedded: listen on a free port
		Embedded: nats.EmbeddedConfig{
			Enabled:  true,
			StoreDir: storeDir,
			Sync:     nats.SyncAlways,
		},
	}, adapters.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer b.Close()

	if err := b.Provision(ctx, "orders.events", "billing"); err != nil {
		fmt.Println(err)
		return
	}
	var batch []adapters.Outgoing
	for i, order := range []string{"order-1", "order-2", "order-1"} {
		msg := message.NewMessage(fmt.Sprintf("event-%d", i+1), []byte(`{"total":42}`))
		msg.Metadata.Set("aggregate-id", order)
		batch = append(batch, adapters.Outgoing{Topic: "orders.events", Msg: msg})
	}
	if err := b.PublishBatch(ctx, batch); err != nil {
		fmt.Println(err)
		return
	}

	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: "billing"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()
	messages, err := sub.Subscribe(ctx, "orders.events")
	if err != nil {
		fmt.Println(err)
		return
	}
	for range batch {
		msg := <-messages
		fmt.Println(msg.UUID, msg.Metadata.Get("aggregate-id"))
		msg.Ack()
	}
	// Output:
	// event-1 order-1
	// event-2 order-2
	// event-3 order-1
}

// Topics map to stream and consumer names one to one.
func ExampleStreamName() {
	fmt.Println(nats.StreamName("orders.events"))
	fmt.Println(nats.StreamName("order-created"))
	fmt.Println(nats.ConsumerName("billing_v2"))
	// Output:
	// orders_events
	// order--created
	// billing-_v2
}
