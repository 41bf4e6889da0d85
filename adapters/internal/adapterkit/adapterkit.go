// Package adapterkit holds what the broker adapters (kafka, nats, rabbit)
// share and do not export.
package adapterkit

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/millrace-io/millrace/adapters"
)

// Open is an adapter's Open: it applies cfg's defaults, validates it at
// path (its YAML path, such as "broker.kafka") and opens it with open. The
// problems are one error, "<adapter>: invalid config: …", the same for
// every adapter.
func Open[C interface {
	WithDefaults() C
	Validate(path string) []error
}, B any](ctx context.Context, adapter, path string, cfg C, opts adapters.Options, open func(context.Context, C, adapters.Options) (B, error)) (B, error) {
	cfg = cfg.WithDefaults()
	if problems := cfg.Validate(path); len(problems) > 0 {
		var none B
		return none, fmt.Errorf("%s: invalid config: %w", adapter, errors.Join(problems...))
	}
	return open(ctx, cfg, opts)
}

// SplitURLs splits a comma-separated list of URLs, trimming the spaces
// around each.
func SplitURLs(list string) []string {
	var urls []string
	for u := range strings.SplitSeq(list, ",") {
		urls = append(urls, strings.TrimSpace(u))
	}
	return urls
}
