// Package testlog gives tests a log they can read back: a buffer safe for
// concurrent writes, with slog and Watermill loggers over it that log
// everything, Watermill's trace level included.
package testlog

import (
	"bytes"
	"log/slog"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
)

// Buffer collects what is written to it from any goroutine.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Len returns how many bytes were written so far.
func (b *Buffer) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Len()
}

// Slog returns a text logger writing every level into b.
func (b *Buffer) Slog() *slog.Logger {
	return slog.New(slog.NewTextHandler(b, &slog.HandlerOptions{Level: watermill.LevelTrace}))
}

// Watermill returns Slog as a Watermill logger.
func (b *Buffer) Watermill() watermill.LoggerAdapter {
	return watermill.NewSlogLogger(b.Slog())
}
