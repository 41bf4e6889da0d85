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

	"github.com/millrace-io/millrace/examples/billing"
	"github.com/millrace-io/millrace/examples/orders"
)

func main() {
	configPath := flag.String("config", "config.yaml", "path to config.yaml")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg, db, b, err := orders.Open(ctx, *configPath, billing.Setup)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	defer b.Close()
	if err := b.Handle(orders.Topic, billing.HandlerName, billing.Handler(cfg.Database.Schema)); err != nil {
		log.Fatal(err)
	}
	log.Printf("billing: consuming %s on %s; stop with Ctrl-C", orders.Topic, cfg.Broker.Kind)
	if err := b.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
