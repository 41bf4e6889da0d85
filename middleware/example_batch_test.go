package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// A batch handler writes the invoices of a whole batch with one statement
// in the batch's inbox transaction, and fails the one message it cannot
// take: that message is poisoned alone, the others commit. (Watermill's
// in-memory pub/sub stands for the broker here.)
func ExampleChain_WrapBatch() {
	ctx := context.Background()
	svc, closeService := brokertest.NewExampleService("example_batch")
	defer closeService()
	invoices := svc.Table("invoices")
	if _, err := svc.DB.Exec(`CREATE TABLE ` + invoices + ` (order_id text PRIMARY KEY, amount int NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	stack, err := middleware.New(middleware.Config{
		Workers: 4,
		Batch:   middleware.BatchConfig{MaxMessages: 4, MaxWait: 50 * time.Millisecond},
	}, middleware.Deps{DB: svc.DB, Schema: svc.Config.Database.Schema, Registerer: prometheus.NewRegistry()})
	if err != nil {
		log.Fatal(err)
	}
	chain, err := stack.Chain(middleware.Handler{Name: "billing", Topic: "orders.events", ConsumerGroup: "billing"})
	if err != nil {
		log.Fatal(err)
	}
	handle := chain.WrapBatch(func(ctx context.Context, msgs []*message.Message) error {
		failures := middleware.BatchFailures{}
		var ids []string
		var amounts []int
		for _, msg := range msgs {
			var order struct {
				ID     string `json:"id"`
				Amount int    `json:"amount"`
			}
			if err := middleware.DecodeJSON(msg, &order); err != nil {
				failures[middleware.EventID(msg)] = err // permanent: poisoned at once
				continue
			}
			if order.Amount < 0 {
				failures[middleware.EventID(msg)] = bus.Permanent(errors.New("negative amount"))
				continue
			}
			ids, amounts = append(ids, order.ID), append(amounts, order.Amount)
		}
		if _, err := middleware.Tx(ctx).ExecContext(ctx,
			`INSERT INTO `+invoices+` SELECT * FROM unnest($1::text[], $2::int[])`, ids, amounts); err != nil {
			return err // the whole batch is retried
		}
		if len(failures) > 0 {
			return failures // rolled back; the others are handed over again and commit
		}
		return nil
	})

	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	if err != nil {
		log.Fatal(err)
	}
	router.AddConsumerHandler("billing", "orders.events", consumer.Subscriber(chain, consumer.Source{
		NewSubscriber: func() (message.Subscriber, error) { return broker, nil },
	}), handle)
	go router.Run(ctx) //nolint:errcheck // ends with Close
	<-router.Running()
	for i, amount := range []int{10, 20, -5, 40} {
		msg := message.NewMessage(fmt.Sprintf("evt-%d", i+1), fmt.Appendf(nil, `{"id":"ord-%d","amount":%d}`, i+1, amount))
		if err := broker.Publish("orders.events", msg); err != nil {
			log.Fatal(err)
		}
	}

	var committed, poisoned int
	for committed+poisoned < 4 {
		time.Sleep(20 * time.Millisecond)
		_ = svc.DB.QueryRow(`SELECT count(*) FROM ` + invoices).Scan(&committed)
		_ = svc.DB.QueryRow(`SELECT count(*) FROM "` + svc.Config.Database.Schema + `".millrace_poison`).Scan(&poisoned)
	}
	_ = router.Close()
	var total int
	var reason, eventID string
	_ = svc.DB.QueryRow(`SELECT sum(amount) FROM ` + invoices).Scan(&total)
	_ = svc.DB.QueryRow(`SELECT event_id, reason FROM "`+svc.Config.Database.Schema+`".millrace_poison`).Scan(&eventID, &reason)
	fmt.Println("invoices:", committed, "total:", total)
	fmt.Println("poisoned:", eventID, reason)
	// Output:
	// invoices: 3 total: 70
	// poisoned: evt-3 negative amount
}
