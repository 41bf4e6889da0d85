// Command orders creates orders through the example order service: each
// order and its OrderCreated event commit in one transaction, and one more
// order is rolled back to show that it leaves no event behind.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"

	"github.com/google/uuid"

	"github.com/millrace-io/millrace/examples/orders"
)

func main() {
	configPath := flag.String("config", "config.yaml", "path to config.yaml")
	count := flag.Int("count", 10, "orders to create")
	flag.Parse()
	ctx := context.Background()
	cfg, db, b, err := orders.Open(ctx, *configPath, orders.Setup)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	defer b.Close()
	svc := orders.New(b, db, cfg.Database.Schema)
	for i := range *count {
		o := orders.OrderCreated{OrderID: "ord-" + uuid.NewString()[:8], Customer: "c-42", TotalCents: int64(1000 * (i + 1))}
		if err := svc.Create(ctx, o, nil); err != nil {
			log.Fatal(err)
		}
	}
	declined := errors.New("payment declined")
	err = svc.Create(ctx, orders.OrderCreated{OrderID: "ord-declined-" + uuid.NewString()[:8], Customer: "c-13", TotalCents: 999},
		func() error { return declined })
	if !errors.Is(err, declined) {
		log.Fatalf("the declined order should have rolled back, got %v", err)
	}
	fmt.Printf("created %d orders with their events; 1 declined order rolled back and left no event\n", *count)
}
