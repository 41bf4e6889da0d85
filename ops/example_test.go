package ops_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/ops"
)

// The scheduled events of some ids, such as a saga instance's timeouts:
// those still waiting, with their due times.
func ExampleClient_ScheduledEvents() {
	ctx := context.Background()
	b, svc, closeAll := brokertest.NewExampleBus("example_scheduled_events")
	defer closeAll()
	due := time.Date(2099, 1, 2, 3, 4, 5, 0, time.UTC)
	tx, err := svc.DB.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := b.Schedule(ctx, tx, "orders.saga-timeouts", bus.DueAt(due), bus.Event{ID: "timeout-ord-1",
		Type: "PaymentTimedOut", AggregateType: "order", AggregateID: "ord-1", Payload: []byte(`{}`)}); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}

	oc, err := ops.New(ctx, svc.DB, svc.Config)
	if err != nil {
		log.Fatal(err)
	}
	events, err := oc.ScheduledEvents(ctx, "timeout-ord-1", "timeout-ord-2")
	if err != nil {
		log.Fatal(err)
	}
	for _, ev := range events {
		fmt.Println(ev.ID, ev.Topic, ev.DueAt.UTC().Format(time.RFC3339))
	}
	// Output:
	// timeout-ord-1 orders.saga-timeouts 2099-01-02T03:04:05Z
}

// The events forwarded and processed per minute of the last hour, as the
// console charts them: three events processed by billing's chain, two
// published and not forwarded yet (no relay runs here).
func ExampleClient_Throughput() {
	ctx := context.Background()
	b, svc, closeAll := brokertest.NewExampleBus("example_throughput")
	defer closeAll()
	handle, err := b.ConsumerChain(ctx, "orders.events", "billing", func(context.Context, bus.Event) error { return nil }, nil)
	if err != nil {
		log.Fatal(err)
	}
	for i := range 3 {
		id := fmt.Sprintf("evt-%d", i)
		msg := message.NewMessage(id, []byte(`{}`))
		msg.Metadata = message.Metadata{bus.EventIDKey: id, bus.EventTypeKey: "OrderPlaced",
			bus.AggregateTypeKey: "order", bus.AggregateIDKey: "ord-1"}
		msg.SetContext(ctx)
		if err := handle(msg); err != nil {
			log.Fatal(err)
		}
	}
	for range 2 {
		if err := b.PublishInOwnTx(ctx, "orders.events", bus.Event{Type: "OrderPlaced", AggregateType: "order",
			AggregateID: "ord-2", Payload: []byte(`{}`)}); err != nil {
			log.Fatal(err)
		}
	}

	oc, err := ops.New(ctx, svc.DB, svc.Config)
	if err != nil {
		log.Fatal(err)
	}
	tp, err := oc.Throughput(ctx)
	if err != nil {
		log.Fatal(err)
	}
	total := func(perMinute []int64) (n int64) {
		for _, c := range perMinute {
			n += c
		}
		return n
	}
	for group, perMinute := range tp.Forwarded {
		fmt.Printf("relay group %s: %d minutes, %d forwarded\n", group, len(perMinute), total(perMinute))
	}
	for group, perMinute := range tp.Processed {
		fmt.Printf("consumer group %s: %d minutes, %d processed\n", group, len(perMinute), total(perMinute))
	}
	// Output:
	// relay group millrace_relay: 60 minutes, 0 forwarded
	// consumer group billing: 60 minutes, 3 processed
}
