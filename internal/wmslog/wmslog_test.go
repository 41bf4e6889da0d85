package wmslog

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
)

// The same fields come out in the same order on every line, whatever
// order the map hands them out in.
func TestFieldsInKeyOrder(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := New(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: watermill.LevelTrace})))
	fields := watermill.LogFields{}
	for _, k := range []string{"topic", "handler", "attempts", "event_id", "consumer_group", "wait", "zeta", "alpha"} {
		fields[k] = k
	}
	const lines = 50
	for range lines {
		l.With(watermill.LogFields{"b": 1, "a": 2}).Error("failed", errors.New("boom"), fields)
	}
	out := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Len(t, out, lines)
	want := `level=ERROR msg=failed a=2 b=1 alpha=alpha attempts=attempts consumer_group=consumer_group event_id=event_id ` +
		`handler=handler topic=topic wait=wait zeta=zeta error=boom`
	for _, line := range out {
		_, rest, ok := strings.Cut(line, " level=")
		require.True(t, ok, line)
		require.Equal(t, want, "level="+rest)
	}
}

// Each method logs at its level, Warn included, which Watermill's own
// adapter lacks; a nil error adds no attribute.
func TestLevels(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := New(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: watermill.LevelTrace})))
	l.Trace("t", nil)
	l.Debug("d", nil)
	l.Info("i", nil)
	l.Warn("w", watermill.LogFields{"reason": "bad"})
	l.Error("e", nil, nil)
	var levels []string
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		_, rest, _ := strings.Cut(line, " level=")
		levels = append(levels, rest)
	}
	require.Equal(t, []string{"DEBUG-4 msg=t", "DEBUG msg=d", "INFO msg=i", "WARN msg=w reason=bad", "ERROR msg=e"}, levels)

	buf.Reset()
	quiet := New(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn})))
	quiet.Info("not written", watermill.LogFields{"x": 1})
	quiet.Warn("written", nil)
	require.NotContains(t, buf.String(), "not written")
	require.Contains(t, buf.String(), "written")
}
