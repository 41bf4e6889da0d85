// Package adapterkit holds what the broker adapters (kafka, nats, rabbit)
// share and do not export.
package adapterkit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"strings"
	"sync"

	"github.com/millrace-io/millrace/adapters"
)

// Open is an adapter's Open: it applies cfg's defaults, validates it at
// its YAML path, broker.<kind>, and opens it with open and opts' defaults.
// The problems are one error, "<kind>: invalid config: …", the same for
// every adapter.
func Open[C interface {
	WithDefaults() C
	Validate(path string) []error
}, B any](ctx context.Context, kind string, cfg C, opts adapters.Options, open func(context.Context, C, adapters.Options) (B, error)) (B, error) {
	cfg = cfg.WithDefaults()
	if problems := cfg.Validate("broker." + kind); len(problems) > 0 {
		var none B
		return none, fmt.Errorf("%s: invalid config: %w", kind, errors.Join(problems...))
	}
	return open(ctx, cfg, opts.WithDefaults())
}

// Connect is an adapter's Section.Connect: it opens cfg, which has its
// defaults and which Validate accepted, with open and opts' defaults, and
// returns a nil Broker with an error.
func Connect[C any, B adapters.Broker](ctx context.Context, cfg C, opts adapters.Options, open func(context.Context, C, adapters.Options) (B, error)) (adapters.Broker, error) {
	b, err := open(ctx, cfg, opts.WithDefaults())
	if err != nil {
		return nil, err
	}
	return b, nil
}

// Unreachable is the error of an adapter of kind that cannot connect to
// where (its redacted address) for reason, the same for every adapter:
// "<kind>: cannot connect to <where>: <reason>".
func Unreachable(kind, where string, reason error) error {
	return fmt.Errorf("%s: cannot connect to %s: %w", kind, where, reason)
}

// CloseAll closes every one of closers, a broker's subscribers at its
// Close, and returns their errors joined.
func CloseAll[C io.Closer](closers iter.Seq[C]) error {
	var errs []error
	for c := range closers {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}

// Link is the function a package a program imports on purpose registers
// at init (an in-process dev server: kafkadev, natsdev) for the adapter
// that calls it. The zero Link has none.
type Link[F any] struct {
	mu  sync.RWMutex
	f   F
	set bool
}

// Register makes f the function Func returns.
func (l *Link[F]) Register(f F) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.f, l.set = f, true
}

// Func returns the registered function, and false when none is.
func (l *Link[F]) Func() (F, bool) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.f, l.set
}

// Linked reports whether a function is registered.
func (l *Link[F]) Linked() bool {
	_, ok := l.Func()
	return ok
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

// MarkClosed marks a closer closed: under mu, the first call sets *closed,
// runs take (which moves out what closing releases) and reports true;
// later calls report false.
func MarkClosed(mu *sync.Mutex, closed *bool, take func()) bool {
	mu.Lock()
	defer mu.Unlock()
	if *closed {
		return false
	}
	*closed = true
	take()
	return true
}
