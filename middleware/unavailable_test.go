package middleware_test

import (
	"context"
	"database/sql"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/middleware"
)

// While the database cannot be reached, the inbox transaction never begins:
// the message was never judged, so it keeps waiting (backoff after backoff,
// far past retry.max_attempts) and is returned for redelivery when the
// consumer stops. It is never poisoned.
func TestUnreachableDatabaseUsesNoRetries(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close()) // nothing listens there now
	dead, err := sql.Open("pgx", fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=1", port))
	require.NoError(t, err)
	t.Cleanup(func() { dead.Close() })

	var cfg middleware.Config
	fastRetry(&cfg, 2)
	cfg.Breaker.Enabled = new(false)
	reg := prometheus.NewRegistry()
	stack, err := middleware.New(cfg, middleware.Deps{DB: dead, Schema: e.schema, Registerer: reg, Logger: testLogger()})
	require.NoError(t, err)
	chain, err := stack.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "billing"})
	require.NoError(t, err)
	calls := 0
	handle := chain.Wrap(func(*message.Message) error { calls++; return nil })

	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	msg := event("evt-1", "o-1", 1, `{"amount":1}`)
	msg.SetContext(ctx)
	err = handle(msg)
	require.ErrorContains(t, err, "consumer stopping, message returned for redelivery")
	require.Zero(t, calls, "the handler never ran without its transaction")
	c := &testConsumer{reg: reg}
	require.Zero(t, c.messages(t, "billing", middleware.OutcomeRetried), "no attempt was counted against the message")
	require.Zero(t, c.messages(t, "billing", middleware.OutcomePoisoned))
}
