package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/millrace-io/millrace/bus"
)

var relayMetrics string

func init() {
	commands = append(commands, command{
		path:    "relay",
		summary: "run the relay (outbox -> broker) until SIGTERM/SIGINT; relays of one outbox elect one active, the rest are hot standbys",
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&relayMetrics, "metrics", "", "serve Prometheus metrics at http://ADDR/metrics (overrides metrics.listen)")
		},
		run: runRelay,
	})
}

func runRelay(ctx context.Context, e env, args []string) error {
	if err := noArgs(args); err != nil {
		return err
	}
	cfg := e.cfg
	cfg.Relay.Enabled = new(true)
	if relayMetrics != "" {
		cfg.Metrics.Listen = relayMetrics
		if err := cfg.Validate(); err != nil {
			return usageError{fmt.Errorf("--metrics: %w", err)}
		}
	}
	b, err := bus.Open(ctx, cfg, nil)
	if err != nil {
		return err
	}
	defer b.Close()
	fmt.Fprintf(e.out, "relay: outbox %s.watermill_%s -> %s (stop with SIGTERM)\n", cfg.Database.Schema, cfg.Outbox.Topic, cfg.Broker.Kind)
	return b.Run(ctx)
}
