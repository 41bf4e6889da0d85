package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"

	"github.com/millrace-io/millrace/bus"
)

func init() {
	commands = append(commands, command{
		path:    "relay",
		broker:  true,
		summary: "run the relay (outbox -> broker) until SIGTERM/SIGINT; relays of one outbox elect one active, the rest are hot standbys",
		bind:    stringFlag("metrics", "serve Prometheus metrics at http://ADDR/metrics (overrides metrics.listen)", runRelay),
	})
}

func runRelay(ctx context.Context, e env, args []string, metrics string) error {
	if err := noArgs(args); err != nil {
		return err
	}
	cfg := e.cfg
	cfg.Relay.Enabled = new(true)
	if metrics != "" {
		cfg.Metrics.Listen = metrics
		if err := cfg.Validate(); err != nil {
			return usageError{fmt.Errorf("--metrics: %w", err)}
		}
	}
	b, err := bus.Open[*sql.DB](ctx, cfg, nil)
	if err != nil {
		return err
	}
	defer b.Close()
	outbox := cfg.Database.Schema + ".watermill_" + cfg.Outbox.Topic
	if err := e.print(map[string]string{"status": "running", "outbox": outbox, "broker": cfg.Broker.Kind}, func(w io.Writer) {
		fmt.Fprintf(w, "relay: outbox %s -> %s (stop with SIGTERM)\n", outbox, cfg.Broker.Kind)
	}); err != nil {
		return err
	}
	return b.Run(ctx)
}
