// Package wmslog is millrace's Watermill logger over log/slog. Unlike
// watermill.NewSlogLogger, which ranges over a map, it writes a line's
// fields in the order of their keys, so that two lines of one kind read
// alike and compare line by line; and it has a warn level, for what needs
// an operator's eye without being a fault of the process (a poisoned
// message).
package wmslog

import (
	"context"
	"log/slog"
	"maps"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
)

// Logger is a watermill.LoggerAdapter over a *slog.Logger. Watermill's
// trace level is watermill.LevelTrace, below debug.
type Logger struct {
	l *slog.Logger
}

// New returns a Logger writing to l, or to slog.Default() when l is nil.
func New(l *slog.Logger) *Logger {
	if l == nil {
		l = slog.Default()
	}
	return &Logger{l: l}
}

// Error logs msg at error level with fields, then err (when not nil) under
// "error".
func (l *Logger) Error(msg string, err error, fields watermill.LogFields) {
	l.log(slog.LevelError, msg, fields, err)
}

// Warn logs msg at warn level with fields.
func (l *Logger) Warn(msg string, fields watermill.LogFields) {
	l.log(slog.LevelWarn, msg, fields, nil)
}

// Info logs msg at info level with fields.
func (l *Logger) Info(msg string, fields watermill.LogFields) {
	l.log(slog.LevelInfo, msg, fields, nil)
}

// Debug logs msg at debug level with fields.
func (l *Logger) Debug(msg string, fields watermill.LogFields) {
	l.log(slog.LevelDebug, msg, fields, nil)
}

// Trace logs msg at watermill.LevelTrace with fields.
func (l *Logger) Trace(msg string, fields watermill.LogFields) {
	l.log(watermill.LevelTrace, msg, fields, nil)
}

// With returns a Logger that adds fields, in the order of their keys, to
// every line before the line's own.
func (l *Logger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	attrs := sortedAttrs(fields)
	args := make([]any, len(attrs))
	for i, a := range attrs {
		args[i] = a
	}
	return &Logger{l: l.l.With(args...)}
}

func (l *Logger) log(level slog.Level, msg string, fields watermill.LogFields, err error) {
	ctx := context.Background()
	if !l.l.Enabled(ctx, level) {
		return
	}
	attrs := sortedAttrs(fields)
	if err != nil {
		attrs = append(attrs, slog.Any("error", err))
	}
	l.l.LogAttrs(ctx, level, msg, attrs...)
}

// sortedAttrs returns fields as slog attributes in the order of their keys.
func sortedAttrs(fields watermill.LogFields) []slog.Attr {
	attrs := make([]slog.Attr, 0, len(fields)+1)
	for _, k := range slices.Sorted(maps.Keys(fields)) {
		attrs = append(attrs, slog.Any(k, fields[k]))
	}
	return attrs
}
