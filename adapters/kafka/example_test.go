package kafka_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	_ "github.com/millrace-io/millrace/adapters/kafka/kafkadev" // broker.kafka.dev_cluster needs it linked
	"github.com/millrace-io/millrace/internal/envelope"
)

// Open a Broker on an in-process dev cluster, provision a topic and its
// consumer group, publish a batch and consume it. With a real cluster, leave
// DevCluster false and list its brokers; DevCluster needs package kafkadev
// imported.
func Example() {
	ctx := context.Background()
	b, err := kafka.Open(ctx, kafka.Config{
		Brokers:    []string{"127.0.0.1:0"}, // port 0: any free port
		DevCluster: true,
	}, adapters.Options{ConnectTimeout: 10 * time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer b.Close()

	if err := b.Provision(ctx, "orders", "billing"); err != nil {
		fmt.Println(err)
		return
	}

	var batch []adapters.Outgoing
	for i, order := range []string{"order-1", "order-2", "order-1"} {
		msg := message.NewMessage(fmt.Sprintf("event-%d", i+1), fmt.Appendf(nil, `{"n":%d}`, i+1))
		msg.Metadata.Set(envelope.AggregateIDKey, order) // the partition key
		batch = append(batch, adapters.Outgoing{Topic: "orders", Msg: msg})
	}
	if err := b.PublishBatch(ctx, batch); err != nil {
		fmt.Println(err) // a *adapters.BatchError says which messages failed
		return
	}

	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: "billing"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		fmt.Println(err)
		return
	}
	got := map[string]string{}
	for len(got) < len(batch) {
		m := <-msgs
		got[m.UUID] = m.Metadata.Get(envelope.AggregateIDKey) + " " + string(m.Payload)
		m.Ack() // only acked messages are committed
	}
	fmt.Println(got["event-1"])
	fmt.Println(got["event-2"])
	fmt.Println(got["event-3"])
	// Output:
	// order-1 {"n":1}
	// order-2 {"n":2}
	// order-1 {"n":3}
}

// An ordered subscriber hands out many messages of one partition at once,
// one per aggregate: the next event of an aggregate comes once the one
// before it is acked, while other aggregates go on.
func ExampleBroker_Subscriber_ordered() {
	ctx := context.Background()
	b, err := kafka.Open(ctx, kafka.Config{
		Brokers:    []string{"127.0.0.1:0"},
		DevCluster: true,
		Partitions: 1, // every aggregate on one partition
	}, adapters.Options{ConnectTimeout: 10 * time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer b.Close()
	if err := b.Provision(ctx, "orders", "shipping"); err != nil {
		fmt.Println(err)
		return
	}
	var batch []adapters.Outgoing
	for i, order := range []string{"order-1", "order-2", "order-1", "order-2"} {
		msg := message.NewMessage(fmt.Sprintf("event-%d", i+1), fmt.Appendf(nil, `{"n":%d}`, i+1))
		msg.Metadata.Set(envelope.AggregateIDKey, order)
		batch = append(batch, adapters.Outgoing{Topic: "orders", Msg: msg})
	}
	if err := b.PublishBatch(ctx, batch); err != nil {
		fmt.Println(err)
		return
	}

	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: "shipping", Ordered: true, InFlight: 16}) // up to 16 in flight
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		fmt.Println(err)
		return
	}
	first, second := <-msgs, <-msgs // both in flight, neither acked
	fmt.Println(first.UUID, first.Metadata.Get(envelope.AggregateIDKey))
	fmt.Println(second.UUID, second.Metadata.Get(envelope.AggregateIDKey))
	select {
	case m := <-msgs:
		fmt.Println("unexpected:", m.UUID)
	case <-time.After(200 * time.Millisecond):
		fmt.Println("event-3 and event-4 wait for their aggregates")
	}
	first.Ack()
	third := <-msgs
	fmt.Println(third.UUID, "after event-1's ack")
	second.Ack()
	fourth := <-msgs
	fmt.Println(fourth.UUID, "after event-2's ack")
	third.Ack()
	fourth.Ack()
	// Output:
	// event-1 order-1
	// event-2 order-2
	// event-3 and event-4 wait for their aggregates
	// event-3 after event-1's ack
	// event-4 after event-2's ack
}
