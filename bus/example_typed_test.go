package bus_test

import (
	"context"
	"fmt"
	"log"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/ops"
)

// OrderPlacedV1 is the first version of the OrderPlaced event: the total
// in euros.
type OrderPlacedV1 struct {
	OrderID string  `json:"order_id"`
	Total   float64 `json:"total"`
}

// EventType is the wire name, the same in every version.
func (OrderPlacedV1) EventType() string { return "OrderPlaced" }

// OrderPlaced is version 2: the total in cents.
type OrderPlaced struct {
	OrderID    string `json:"order_id"`
	TotalCents int64  `json:"total_cents"`
}

// EventType is the wire name: renaming the Go type does not change it.
func (OrderPlaced) EventType() string { return "OrderPlaced" }

// Aggregate is the order the event is about: the partition and ordering key.
func (e OrderPlaced) Aggregate() (string, string) { return "order", e.OrderID }

// OrderPlacedFromV1 upcasts version 1 to version 2.
func OrderPlacedFromV1(v OrderPlacedV1) (OrderPlaced, error) {
	return OrderPlaced{OrderID: v.OrderID, TotalCents: int64(v.Total*100 + 0.5)}, nil
}

// A topic is declared once with its event type, version and upcasters; its
// events carry the wire name, version and codec's content type.
func ExampleNewTopic() {
	orderPlaced, err := bus.NewTopic[OrderPlaced]("orders.events", bus.Version(2), bus.Upcast(1, OrderPlacedFromV1))
	if err != nil {
		log.Fatal(err)
	}
	ev, err := orderPlaced.Event(OrderPlaced{OrderID: "ord-1", TotalCents: 4200})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(ev.Type, ev.SchemaVersion, ev.ContentType, ev.AggregateType, ev.AggregateID)
	fmt.Println(string(ev.Payload))

	// A mistake in the declaration is an error naming it.
	_, err = bus.NewTopic[OrderPlaced]("orders.events", bus.Version(3), bus.Upcast(1, OrderPlacedFromV1))
	fmt.Println(err)
	// Output:
	// OrderPlaced 2 application/json order ord-1
	// {"order_id":"ord-1","total_cents":4200}
	// millrace: NewTopic[bus_test.OrderPlaced]("orders.events"): no upcaster from version 2: the one from version 1 cannot reach version 3
}

// A typed value is published in the caller's transaction; a value of
// another type does not compile.
func ExampleTopic_Publish() {
	ctx := context.Background()
	b, svc, closeAll := brokertest.NewExampleBus("example_typed_publish")
	defer closeAll()
	orderPlaced := bus.Must(bus.NewTopic[OrderPlaced]("orders.events", bus.Version(2), bus.Upcast(1, OrderPlacedFromV1)))

	tx, err := svc.DB.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	// ... the business write goes here, on tx ...
	if err := orderPlaced.Publish(ctx, b, tx, OrderPlaced{OrderID: "ord-1", TotalCents: 4200}); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	printOutboxRows(svc)
	// Output: outbox rows: 1
}

// One handler, one consumer group, routes each event type on a topic to
// its own function: version 1 arrives upcast, a version this consumer does
// not know yet is poisoned with a reason naming both, and a type it has no
// route for (another handler's) is acked without a call.
func ExampleBus_HandleTypes() {
	ctx := context.Background()
	b, svc, closeAll := brokertest.NewExampleBus("example_handle_types")
	defer closeAll()
	orderPlaced := bus.Must(bus.NewTopic[OrderPlaced]("orders.events", bus.Version(2), bus.Upcast(1, OrderPlacedFromV1)))
	orderCancelled := bus.Must(bus.NewTopic[OrderCancelled]("orders.events"))

	routes := []bus.Route{
		bus.On(orderPlaced, func(ctx context.Context, m bus.Message[OrderPlaced]) error {
			fmt.Printf("placed %s: %d cents (published as version %d)\n", m.Value.OrderID, m.Value.TotalCents, m.SchemaVersion)
			return nil
		}),
		bus.On(orderCancelled, func(ctx context.Context, m bus.Message[OrderCancelled]) error {
			fmt.Println("cancelled", m.Value.OrderID)
			return nil
		}),
	}
	// b.HandleTypes("billing", routes) registers them for Run; here the same
	// chain gets messages as a broker would deliver them.
	handle, err := b.ConsumerChainTypes(ctx, "billing", routes, nil)
	if err != nil {
		log.Fatal(err)
	}
	deliver := func(id, eventType string, version int, payload string) {
		msg := message.NewMessage(id, []byte(payload))
		msg.Metadata = message.Metadata{bus.EventIDKey: id, bus.EventTypeKey: eventType, bus.SchemaVersionKey: strconv.Itoa(version),
			bus.AggregateTypeKey: "order", bus.AggregateIDKey: "ord-1", bus.ContentTypeKey: "application/json"}
		msg.SetContext(ctx)
		if err := handle(msg); err != nil {
			log.Fatal(err)
		}
	}
	deliver("evt-1", "OrderPlaced", 1, `{"order_id":"ord-1","total":42.5}`)
	deliver("evt-2", "OrderCancelled", 1, `{"order_id":"ord-1"}`)
	deliver("evt-3", "OrderPlaced", 3, `{"order_id":"ord-1","total_cents":1,"currency":"EUR"}`)
	deliver("evt-4", "OrderShipped", 1, `{"order_id":"ord-1"}`)

	oc, err := ops.New(ctx, svc.DB, svc.Config)
	if err != nil {
		log.Fatal(err)
	}
	poisoned, err := oc.DLQ().List(ctx, ops.Filter{Handler: "billing"}, 0)
	if err != nil {
		log.Fatal(err)
	}
	for i := len(poisoned.Rows) - 1; i >= 0; i-- { // oldest first
		m := poisoned.Rows[i]
		fmt.Println("poisoned", m.EventID+":", m.Reason)
	}
	// Output:
	// placed ord-1: 4250 cents (published as version 1)
	// cancelled ord-1
	// poisoned evt-3: invalid metadata.schema-version: event type OrderPlaced has schema version 3, newer than version 2, the newest this consumer knows: deploy a consumer that knows version 3, then replay the event
}

// OrderCancelled is another event type of the orders.events topic.
type OrderCancelled struct {
	OrderID string `json:"order_id"`
}

// EventType is the wire name.
func (OrderCancelled) EventType() string { return "OrderCancelled" }

// Aggregate is the order the event is about.
func (e OrderCancelled) Aggregate() (string, string) { return "order", e.OrderID }
