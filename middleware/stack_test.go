package middleware_test

import (
	"context"
	"database/sql"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/middleware"
)

func TestChainRefusesWhatCannotWork(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	stack, err := middleware.New(middleware.Config{}, middleware.Deps{DB: e.db, Schema: e.schema})
	require.NoError(t, err)

	_, err = stack.Chain(middleware.Handler{Name: "", Topic: "orders; drop", ConsumerGroup: ""})
	require.ErrorContains(t, err, "handler.name: required")
	require.ErrorContains(t, err, "handler.topic: must match")
	require.ErrorContains(t, err, "handler.consumer_group: must not be empty")

	_, err = stack.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "billing"})
	require.NoError(t, err)
	_, err = stack.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "other"})
	require.ErrorContains(t, err, `handler "billing" already has a chain`)
	_, err = stack.Chain(middleware.Handler{Name: "audit", Topic: "orders", ConsumerGroup: "billing"})
	require.ErrorContains(t, err, `share consumer group "billing" with the inbox on`)

	noDB, err := middleware.New(middleware.Config{}, middleware.Deps{})
	require.NoError(t, err)
	_, err = noDB.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "billing"})
	require.ErrorContains(t, err, "Deps.DB is required")

	topicPoison, err := middleware.New(middleware.Config{
		Inbox:  middleware.InboxConfig{Enabled: new(false)},
		Poison: middleware.PoisonConfig{Destination: middleware.PoisonToTopic, Topic: "orders.poison"},
	}, middleware.Deps{})
	require.NoError(t, err)
	_, err = topicPoison.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "billing"})
	require.ErrorContains(t, err, "Deps.PoisonPublisher is nil")

	_, err = middleware.New(middleware.Config{Workers: -1}, middleware.Deps{})
	require.ErrorContains(t, err, "consumer.workers: must be greater than 0; got -1")
}

func TestCheckReportsAMissingMigration(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	schema := testdb.Schema(t, db) // empty: not migrated
	stack, err := middleware.New(middleware.Config{}, middleware.Deps{DB: db, Schema: schema})
	require.NoError(t, err)
	require.ErrorContains(t, stack.Check(context.Background()), "millrace_inbox\" does not exist: run `millrace migrate`")
}

func TestPruneInboxDeletesExpiredRowsInBatches(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	_, err := e.db.Exec(`INSERT INTO ` + e.table("millrace_inbox") + ` (consumer_group, event_id, processed_at)
		SELECT 'g' || (n % 2), 'old-' || n, now() - interval '40 days' FROM generate_series(1, 2500) n`)
	require.NoError(t, err)
	_, err = e.db.Exec(`INSERT INTO ` + e.table("millrace_inbox") + ` (consumer_group, event_id)
		SELECT 'g0', 'new-' || n FROM generate_series(1, 30) n`)
	require.NoError(t, err)

	month, err := middleware.New(middleware.Config{Inbox: middleware.InboxConfig{Retention: 30 * 24 * time.Hour, CleanupBatch: 1000}},
		middleware.Deps{DB: e.db, Schema: e.schema})
	require.NoError(t, err)
	n, err := month.PruneInbox(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 2500, n)
	require.Equal(t, 30, e.rows(t, "millrace_inbox", ""))
	require.Zero(t, e.rows(t, "millrace_inbox", `event_id LIKE 'old-%'`))

	// The Stack's runner prunes with the configured window and reports the
	// table's size per consumer group.
	reg := prometheus.NewRegistry()
	stack, err := middleware.New(middleware.Config{Inbox: middleware.InboxConfig{Retention: time.Hour, CleanupBatch: 7}},
		middleware.Deps{DB: e.db, Schema: e.schema, Registerer: reg})
	require.NoError(t, err)
	_, err = e.db.Exec(`UPDATE ` + e.table("millrace_inbox") + ` SET processed_at = now() - interval '2 hours' WHERE event_id IN ('new-1', 'new-2')`)
	require.NoError(t, err)
	n, err = stack.PruneInbox(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	c := &testConsumer{reg: reg}
	require.EqualValues(t, 28, c.metric(t, middleware.MetricInboxRows, map[string]string{"consumer_group": "g0"}))
	require.EqualValues(t, 2, c.metric(t, middleware.MetricInboxPruned, nil))

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- stack.RunRetention(runCtx) }()
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
}

func TestMetricsAreRegisteredOnTheCallersRegistry(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	gc := gochannel.NewGoChannel(gochannel.Config{}, nil)
	defer gc.Close()
	deps := middleware.Deps{Registerer: reg, PoisonPublisher: gc}
	cfg := middleware.Config{
		Inbox:  middleware.InboxConfig{Enabled: new(false)},
		Poison: middleware.PoisonConfig{Destination: middleware.PoisonToTopic, Topic: "poison"},
	}
	s1, err := middleware.New(cfg, deps)
	require.NoError(t, err)
	_, err = s1.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "billing"})
	require.NoError(t, err)
	_, err = middleware.New(cfg, deps)
	require.NoError(t, err, "a second Stack on the same registry shares the collectors")

	families, err := reg.Gather()
	require.NoError(t, err)
	var names []string
	for _, f := range families {
		names = append(names, f.GetName())
	}
	require.Contains(t, names, middleware.MetricBreakerState, fmt.Sprint(names))
	c := &testConsumer{reg: reg}
	require.EqualValues(t, middleware.BreakerClosed, c.metric(t, middleware.MetricBreakerState, map[string]string{"handler": "billing"}))
	global, err := prometheus.DefaultGatherer.Gather()
	require.NoError(t, err)
	for _, f := range global {
		require.NotContains(t, f.GetName(), "millrace_", "nothing is registered globally")
	}
}

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
