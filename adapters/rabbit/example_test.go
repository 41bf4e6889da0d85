package rabbit_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/rabbit"
	"github.com/millrace-io/millrace/bus"
)

// Open a broker, provision a topic for the "billing" consumer group, relay a
// batch the way the outbox relay does, and consume it.
func Example() {
	ctx := context.Background()
	url := os.Getenv("AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	b, err := rabbit.Open(ctx, rabbit.Config{URL: url}, adapters.Options{ConnectTimeout: 5 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()

	topic := "example.orders-" + watermill.NewShortUUID()
	defer deleteTopology(url, topic, "billing")
	// Queues first: a message published while no group's queue is bound is
	// parked in rabbit.UnroutedQueueName(topic), not delivered.
	if err := b.Provision(ctx, topic, "billing"); err != nil {
		log.Fatal(err)
	}

	var batch []adapters.Outgoing
	for i, kind := range []string{"OrderCreated", "OrderPaid"} {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order_id":"ord-1","step":%d}`, i+1))
		msg.Metadata.Set(bus.AggregateIDKey, "ord-1")
		msg.Metadata.Set(bus.EventTypeKey, kind)
		batch = append(batch, adapters.Outgoing{Topic: topic, Msg: msg})
	}
	if err := b.PublishBatch(ctx, batch); err != nil {
		var be *adapters.BatchError
		if errors.As(err, &be) {
			// Retry from be.FirstUnconfirmed(); adapters.IsPermanent(be.Errs[i])
			// marks a message that retrying cannot fix.
			log.Fatalf("%d messages not confirmed: %v", be.Failed(), err)
		}
		log.Fatal(err)
	}

	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: "billing"})
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		log.Fatal(err)
	}
	for range batch {
		msg := <-msgs
		fmt.Println(msg.Metadata.Get(bus.EventTypeKey), string(msg.Payload))
		msg.Ack() // only Ack removes it; Nack or a crash redelivers it
	}
	// Output:
	// OrderCreated {"order_id":"ord-1","step":1}
	// OrderPaid {"order_id":"ord-1","step":2}
}

// The queues behind a topic and a consumer group, e.g. to read dead
// letters, messages waiting for their next delivery, or parked messages.
func ExampleQueueName() {
	fmt.Println(rabbit.QueueName("orders.events", "billing"))
	fmt.Println(rabbit.DeadLetterQueueName("orders.events", "billing"))
	fmt.Println(rabbit.RetryQueueName("orders.events", "billing"))
	fmt.Println(rabbit.UnroutedQueueName("orders.events"))
	// Output:
	// orders.events:billing
	// orders.events:billing:dlq
	// orders.events:billing:retry
	// orders.events::unrouted
}

// Marshaler also fixes watermill-amqp's own subscriber, whose
// DefaultMarshaler fails on the non-string headers of quorum queues.
func ExampleMarshaler() {
	cfg := wamqp.NewDurablePubSubConfig("amqp://guest:guest@127.0.0.1:5672/", wamqp.GenerateQueueNameTopicNameWithSuffix("billing"))
	cfg.Marshaler = rabbit.Marshaler{}
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()
}

// deleteTopology removes the example's queues and exchanges from the server.
func deleteTopology(url, topic string, groups ...string) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	queues := []string{rabbit.UnroutedQueueName(topic)}
	for _, g := range groups {
		queues = append(queues, rabbit.QueueName(topic, g), rabbit.DeadLetterQueueName(topic, g), rabbit.RetryQueueName(topic, g))
	}
	for _, q := range queues {
		_, _ = ch.QueueDelete(q, false, false, false)
	}
	for _, x := range []string{topic, topic + ":unrouted", topic + ":dlx"} {
		_ = ch.ExchangeDelete(x, false, false)
	}
}
