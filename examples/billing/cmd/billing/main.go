// Command billing runs the example billing consumer until SIGTERM or
// Ctrl-C, on the broker config.yaml names. With relay.enabled (the
// default) it also relays the outbox.
package main

import (
	"context"
	"flag"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/examples/billing"
	"github.com/millrace-io/millrace/examples/orders"
)

func main() {
	configPath := flag.String("config", "config.yaml", "path to config.yaml")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg, err := bus.LoadConfig(*configPath)
	if err != nil {
		log.Fatal(err)
	}
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if err := bus.Migrate(ctx, db, cfg); err != nil {
		log.Fatal(err)
	}
	if err := billing.Setup(ctx, db, cfg.Database.Schema); err != nil {
		log.Fatal(err)
	}
	b, err := bus.Open(ctx, cfg, db)
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	if err := b.Handle(orders.Topic, billing.HandlerName, billing.Handler(cfg.Database.Schema)); err != nil {
		log.Fatal(err)
	}
	log.Printf("billing: consuming %s on %s; stop with Ctrl-C", orders.Topic, cfg.Broker.Kind)
	if err := b.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
