package middleware_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// A service wires one chain per handler into Watermill's router: the chain
// as the handler's middleware, the Dispatcher as its subscriber. Tx gives the
// handler the inbox transaction for its business writes.
func Example() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	stack, err := middleware.New(middleware.Config{}, middleware.Deps{
		DB:         db,
		Registerer: prometheus.NewRegistry(),
		Logger:     watermill.NewSlogLogger(slog.Default()),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := stack.Check(ctx); err != nil { // tables migrated?
		log.Fatal(err)
	}
	go stack.RunRetention(ctx) //nolint:errcheck // ends with ctx

	chain, err := stack.Chain(middleware.Handler{Name: "billing", Topic: "orders.events", ConsumerGroup: "billing"})
	if err != nil {
		log.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 40 * time.Second}, nil)
	if err != nil {
		log.Fatal(err)
	}
	source := consumer.Source{
		Competing: true, // a RabbitMQ queue or a NATS durable consumer per group
		NewSubscriber: func() (message.Subscriber, error) {
			return newBrokerSubscriber("billing") // the broker adapter's Subscriber(group)
		},
	}
	router.AddConsumerHandler("billing", "orders.events", consumer.Subscriber(chain, source), chain.Wrap(func(msg *message.Message) error {
		var order struct {
			ID     string `json:"id"`
			Amount int    `json:"amount"`
		}
		if err := middleware.DecodeJSON(msg, &order); err != nil {
			return err // permanent: poisoned at once, with the field named
		}
		if order.Amount < 0 {
			return bus.Permanent(errors.New("negative amount"))
		}
		_, err := middleware.Tx(msg.Context()).ExecContext(msg.Context(),
			`INSERT INTO invoices (order_id, amount) VALUES ($1, $2)`, order.ID, order.Amount)
		return err // a transient error is retried; nil commits, then acks
	}))
	if err := router.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

// newBrokerSubscriber stands for the broker adapter's Subscriber(group).
func newBrokerSubscriber(string) (message.Subscriber, error) {
	return nil, errors.New("no broker here")
}

// An override in consumer.handlers changes only the fields it sets.
func ExampleConfig_For() {
	cfg, err := bus.ParseConfig([]byte(`
broker:
  nats: {url: "nats://127.0.0.1:4222"}
consumer:
  workers: 4
  retry:
    max_attempts: 3
    initial_interval: 1s
  handlers:
    billing:
      ordered: true
      retry:
        max_attempts: 10
`))
	if err != nil {
		log.Fatal(err)
	}
	billing := cfg.Consumer.For("billing")
	fmt.Println("workers:", billing.Workers)
	fmt.Println("ordered:", *billing.Ordered)
	fmt.Println("max attempts:", billing.Retry.MaxAttempts)
	fmt.Println("initial interval:", billing.Retry.InitialInterval)
	fmt.Println("jitter:", *billing.Retry.Jitter)
	// Output:
	// workers: 4
	// ordered: true
	// max attempts: 10
	// initial interval: 1s
	// jitter: true
}

// Validate names the YAML path of every problem.
func ExampleConfig_Validate() {
	cfg := middleware.Config{
		Retry:    middleware.RetryConfig{MaxAttempts: -1},
		Handlers: map[string]middleware.Config{"billing": {Poison: middleware.PoisonConfig{Destination: "queue"}}},
	}.WithDefaults()
	for _, err := range cfg.Validate("consumer") {
		fmt.Println(err)
	}
	cfg.Retry.MaxAttempts = 5
	for _, err := range cfg.Validate("consumer") {
		fmt.Println(err)
	}
	// Output:
	// consumer.retry.max_attempts: must be greater than 0; got -1
	// consumer.handlers.billing.poison.destination: must be one of table, topic; got "queue"
}

// One classification for the whole chain: permanent errors are poisoned at
// once, everything else is retried.
func ExampleIsRetryable() {
	timeout := errors.New("ledger: i/o timeout")
	fmt.Println(middleware.IsRetryable(timeout))
	fmt.Println(middleware.IsRetryable(bus.Permanent(errors.New("negative amount"))))
	fmt.Println(middleware.IsRetryable(fmt.Errorf("decode: %w", middleware.DecodeJSON(message.NewMessage("m-1", []byte(`{"amount":"ten"}`)), &struct{ Amount int }{}))))
	// Output:
	// true
	// false
	// false
}

// A payload of the wrong shape is a permanent error naming the field.
func ExampleDecodeJSON() {
	msg := message.NewMessage("evt-1", []byte(`{"amount":"ten"}`))
	var order struct {
		Amount int `json:"amount"`
	}
	err := middleware.DecodeJSON(msg, &order)
	fmt.Println(err)
	fmt.Println(middleware.IsPermanent(err))
	// Output:
	// invalid payload.amount: expected int, got JSON string
	// true
}

// Batched inbox transactions for one handler: up to 32 of its messages in
// flight share a transaction and a COMMIT. Batch settings are checked like
// any other, under their YAML path.
func ExampleBatchConfig() {
	cfg := middleware.Config{
		Handlers: map[string]middleware.Config{
			"billing": {Workers: 32, Batch: middleware.BatchConfig{MaxMessages: 32, MaxWait: 5 * time.Millisecond}},
			"audit":   {Batch: middleware.BatchConfig{MaxMessages: 100}},
		},
	}.WithDefaults()
	billing := cfg.For("billing")
	fmt.Println(billing.Batch.MaxMessages, billing.Batch.MaxWait, cfg.For("shipping").Batch.MaxMessages)
	for _, err := range cfg.Validate("consumer") {
		fmt.Println(err)
	}
	// Output:
	// 32 5ms 1
	// consumer.handlers.audit.batch.max_messages: must be at most 64; got 100
}
