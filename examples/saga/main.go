// Command saga runs the order process of an online shop as a millrace saga:
// order placed -> charge the payment -> reserve the stock -> notify the
// customer, refunding the payment when the stock is missing and cancelling
// the order when the payment does not answer in time. The payment and
// inventory services are handlers in the same process that answer the
// saga's commands. It places three orders (one goes through, one has no
// stock, one is never paid), waits until the three sagas have completed and
// prints what happened to each.
//
// The broker is examples/saga/config.yaml's broker.kind, NATS
// (MILLRACE_BROKER_KIND overrides it: kafka, rabbitmq or nats). NATS and
// RabbitMQ are the local servers `make up` provides; Kafka is an in-process
// dev cluster unless KAFKA_BROKERS names a real one. The streams, queues,
// exchanges or topics the example created are deleted when it ends.
//
//	make saga BROKER=kafka   # or: make demo SAGA=1 BROKER=rabbitmq
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/google/uuid"

	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/ops"
)

// The events the saga reads.
type (
	// OrderPlaced starts the saga.
	OrderPlaced struct {
		OrderID string `json:"order_id"`
	}
	// PaymentCharged is the payment service's answer.
	PaymentCharged struct {
		OrderID string `json:"order_id"`
	}
	// StockReserved and StockMissing are the inventory service's answers.
	StockReserved struct {
		OrderID string `json:"order_id"`
	}
	StockMissing struct {
		OrderID string `json:"order_id"`
	}
	// PaymentTimedOut is the saga's own timeout, a scheduled event.
	PaymentTimedOut struct {
		OrderID string `json:"order_id"`
	}
)

func (OrderPlaced) EventType() string                 { return "OrderPlaced" }
func (e OrderPlaced) Aggregate() (string, string)     { return "order", e.OrderID }
func (PaymentCharged) EventType() string              { return "PaymentCharged" }
func (e PaymentCharged) Aggregate() (string, string)  { return "order", e.OrderID }
func (StockReserved) EventType() string               { return "StockReserved" }
func (e StockReserved) Aggregate() (string, string)   { return "order", e.OrderID }
func (StockMissing) EventType() string                { return "StockMissing" }
func (e StockMissing) Aggregate() (string, string)    { return "order", e.OrderID }
func (PaymentTimedOut) EventType() string             { return "PaymentTimedOut" }
func (e PaymentTimedOut) Aggregate() (string, string) { return "order", e.OrderID }

// OrderProcess is the saga's state, one per order.
type OrderProcess struct {
	Step    string   `json:"step"`
	History []string `json:"history"`
}

func (p *OrderProcess) note(step, what string) {
	p.Step = step
	p.History = append(p.History, what)
}

func main() {
	if err := start(); err != nil {
		log.Fatal(err)
	}
}

// start runs the example on the configured broker, starting the Kafka dev
// cluster for it when Kafka is the broker and KAFKA_BROKERS names none.
func start() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg, err := bus.LoadConfig("examples/saga/config.yaml")
	if err != nil {
		return err
	}
	if cfg.Broker.Kind == bus.KindKafka && os.Getenv("KAFKA_BROKERS") == "" {
		dev, err := kafkadev.Start(kafkadev.Options{})
		if err != nil {
			return err
		}
		defer dev.Close()
		cfg.Broker.Kafka.Brokers = dev.Addrs()
	}
	fmt.Printf("order saga on %s\n", cfg.Broker.Kind)
	return run(ctx, cfg, "shop", 2*time.Second, os.Stdout)
}

// quiet keeps the output to what happened to each order: only warnings and
// errors are logged (to stderr).
var quiet = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

// topics are the example's topics, named after prefix.
type topics struct {
	orders, payments, inventory, timeouts, commands string
}

func run(ctx context.Context, cfg bus.Config, prefix string, paymentTimeout time.Duration, out io.Writer) error {
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := bus.Migrate(ctx, db, cfg); err != nil {
		return err
	}
	b, err := bus.Open(ctx, cfg, db, bus.WithLogger(quiet))
	if err != nil {
		return err
	}
	defer b.Close()
	tp := topics{orders: prefix + ".orders", payments: prefix + ".payments", inventory: prefix + ".inventory",
		timeouts: prefix + ".order-timeouts", commands: prefix + ".commands"}
	// Registered before b.Close, so it runs after the consumers have left.
	defer deprovision(ctx, cfg, tp, prefix, out)
	placed := bus.Must(bus.NewTopic[OrderPlaced](tp.orders))
	charged := bus.Must(bus.NewTopic[PaymentCharged](tp.payments))
	reserved := bus.Must(bus.NewTopic[StockReserved](tp.inventory))
	missing := bus.Must(bus.NewTopic[StockMissing](tp.inventory))
	timedOut := bus.Must(bus.NewTopic[PaymentTimedOut](tp.timeouts))

	// send publishes a command in the step's transaction: it is sent only
	// if the step's state change commits.
	send := func(ctx context.Context, command, order string) error {
		return b.Publish(ctx, bus.Tx[bus.Execer](ctx), tp.commands, bus.Event{Type: command, AggregateType: "order", AggregateID: order, Payload: []byte(`{}`)})
	}
	saga := bus.NewSaga[OrderProcess]("order_process")
	bus.StartWith(saga, placed, func(m bus.Message[OrderPlaced]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[OrderProcess], m bus.Message[OrderPlaced]) error {
			sc.State.note("charging", "placed; payment requested")
			late, err := timedOut.Event(PaymentTimedOut{OrderID: sc.ID})
			if err != nil {
				return err
			}
			if err := sc.ScheduleTimeout(ctx, "payment", tp.timeouts, bus.DueIn(paymentTimeout), late); err != nil {
				return err
			}
			return send(ctx, "ChargePayment", sc.ID)
		})
	bus.Then(saga, charged, func(m bus.Message[PaymentCharged]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[OrderProcess], m bus.Message[PaymentCharged]) error {
			if err := sc.CancelTimeout(ctx, "payment"); err != nil {
				return err
			}
			sc.State.note("reserving", "paid; stock requested")
			return send(ctx, "ReserveStock", sc.ID)
		})
	bus.Then(saga, reserved, func(m bus.Message[StockReserved]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[OrderProcess], m bus.Message[StockReserved]) error {
			sc.State.note("shipped", "stock reserved; customer notified")
			sc.Complete()
			return send(ctx, "NotifyCustomer", sc.ID)
		})
	bus.Then(saga, missing, func(m bus.Message[StockMissing]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[OrderProcess], m bus.Message[StockMissing]) error {
			sc.State.note("refunded", "no stock; payment refunded")
			sc.Complete()
			return send(ctx, "RefundPayment", sc.ID) // the compensation
		})
	bus.Then(saga, timedOut, func(m bus.Message[PaymentTimedOut]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[OrderProcess], m bus.Message[PaymentTimedOut]) error {
			if sc.State.Step != "charging" {
				return nil // the payment answered first
			}
			sc.State.note("cancelled", "payment timed out; order cancelled")
			sc.Complete()
			return send(ctx, "CancelOrder", sc.ID)
		})
	if err := saga.Handle(b, prefix+"-order-process"); err != nil {
		return err
	}

	// The payment and inventory services: they answer the saga's commands
	// in their own inbox transactions. An order whose id says "unpaid" is
	// never paid; one whose id says "nostock" has no stock.
	if err := b.Handle(tp.commands, prefix+"-payments", func(ctx context.Context, ev bus.Event) error {
		if ev.Type != "ChargePayment" || strings.Contains(ev.AggregateID, "unpaid") {
			return nil
		}
		return charged.Publish(ctx, b, bus.Tx[bus.Execer](ctx), PaymentCharged{OrderID: ev.AggregateID})
	}); err != nil {
		return err
	}
	if err := b.Handle(tp.commands, prefix+"-inventory", func(ctx context.Context, ev bus.Event) error {
		switch {
		case ev.Type != "ReserveStock":
			return nil
		case strings.Contains(ev.AggregateID, "nostock"):
			return missing.Publish(ctx, b, bus.Tx[bus.Execer](ctx), StockMissing{OrderID: ev.AggregateID})
		}
		return reserved.Publish(ctx, b, bus.Tx[bus.Execer](ctx), StockReserved{OrderID: ev.AggregateID})
	}); err != nil {
		return err
	}

	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	ran := make(chan error, 1)
	go func() { ran <- b.Run(runCtx) }()

	tag := uuid.NewString()[:8]
	orders := []string{"ord-" + tag + "-ok", "ord-" + tag + "-nostock", "ord-" + tag + "-unpaid"}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	for _, id := range orders {
		if err := placed.Publish(ctx, b, tx, OrderPlaced{OrderID: id}); err != nil {
			_ = tx.Rollback()
			return err
		}
	}
	if err := tx.Commit(); err != nil {
		return err
	}

	oc, err := ops.New(ctx, db, cfg)
	if err != nil {
		return err
	}
	done, err := waitForSagas(ctx, oc, orders, ran)
	if err != nil {
		return err
	}
	for _, id := range orders {
		var state OrderProcess
		if err := json.Unmarshal(done[id].State, &state); err != nil {
			return err
		}
		fmt.Fprintf(out, "%s: %s (%s)\n", id, state.Step, strings.Join(state.History, " -> "))
	}
	stopRun()
	return <-ran
}

// deprovision deletes the topology the run created on the broker: each
// topic with the consumer groups that read it (the saga's, named
// <handler>.<topic>, and the two services').
func deprovision(ctx context.Context, cfg bus.Config, tp topics, prefix string, out io.Writer) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	broker, err := bus.OpenBroker(ctx, cfg, nil)
	if err != nil {
		fmt.Fprintf(out, "cleanup: %v\n", err)
		return
	}
	defer broker.Close()
	groups := map[string][]string{tp.commands: {prefix + "-payments", prefix + "-inventory"}}
	for _, topic := range []string{tp.orders, tp.payments, tp.inventory, tp.timeouts} {
		groups[topic] = []string{prefix + "-order-process." + topic}
	}
	for topic, gs := range groups {
		if err := broker.Deprovision(ctx, topic, gs...); err != nil {
			fmt.Fprintf(out, "cleanup %s: %v\n", topic, err)
		}
	}
}

// waitForSagas polls until every order's saga has completed, Run fails, or
// ctx ends.
func waitForSagas(ctx context.Context, oc *ops.Client, orders []string, ran <-chan error) (map[string]ops.SagaInstance, error) {
	for {
		done := map[string]ops.SagaInstance{}
		for _, id := range orders {
			inst, err := oc.Saga(ctx, "order_process", id)
			if err == nil && inst.CompletedAt != nil {
				done[id] = inst
			}
		}
		if len(done) == len(orders) {
			return done, nil
		}
		select {
		case err := <-ran:
			return nil, fmt.Errorf("run stopped before the sagas completed: %w", err)
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}
