package middleware_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/middleware"
)

// BenchmarkConsumerThroughput consumes b.N events three times over one
// broker, 8 workers each time, and reports the three rates side by side:
//
//   - noop_msgs/s: a bare Watermill handler that only acks (the broker's ceiling);
//   - bare_msgs/s: a bare Watermill handler doing the business write in its
//     own transaction, without inbox or middleware;
//   - chain_msgs/s: the same write through millrace's full chain with the
//     inbox on (inbox insert in the same transaction, retry, breaker, poison
//     queue, metrics);
//
// and chain/bare, the share of the bare rate the chain keeps (target >= 0.5).
// All three run on the same Dispatcher, so only the chain differs.
// MILLRACE_BENCH_BROKERS picks the brokers (default gochannel,nats,rabbitmq).
func BenchmarkConsumerThroughput(b *testing.B) {
	brokers := kitNames
	if v := os.Getenv("MILLRACE_BENCH_BROKERS"); v != "" {
		brokers = strings.Split(v, ",")
	}
	for _, name := range brokers {
		b.Run(name, func(b *testing.B) {
			e := newEnv(b)
			e.db.SetMaxIdleConns(16) // 8 workers: keep their connections instead of reopening them
			k := newKit(b, name, kitOptions{maxAckPending: 8})
			cfg := middleware.Config{Workers: 8}
			noopHandler := func(*message.Message) error { return nil }
			bareHandler := func(msg *message.Message) error {
				tx, err := e.db.BeginTx(msg.Context(), nil)
				if err != nil {
					return err
				}
				defer tx.Rollback() //nolint:errcheck // a no-op after Commit
				if _, err := tx.ExecContext(msg.Context(), `INSERT INTO `+e.table("business")+` (consumer_group, event_id, aggregate_id, version) VALUES ($1, $2, $3, 1)`,
					"bare", msg.Metadata.Get(bus.EventIDKey), msg.Metadata.Get(bus.AggregateIDKey)); err != nil {
					return err
				}
				return tx.Commit()
			}
			chainHandler := func(msg *message.Message) error { return e.write(msg.Context(), "chain", msg) }
			// The machine is shared: bare and chain run in alternating rounds
			// so that a change of load affects both alike.
			const rounds = 3
			var noopTime, bareTime, chainTime time.Duration
			var noopN, bareN, chainN int
			for r := range rounds {
				n := b.N / rounds
				if r == rounds-1 {
					n = b.N - n*(rounds-1)
				}
				if n == 0 {
					continue
				}
				noopTime += consumeTime(b, k, e, "noop", n, cfg, false, noopHandler)
				bareTime += consumeTime(b, k, e, "bare", n, cfg, false, bareHandler)
				chainTime += consumeTime(b, k, e, "chain", n, cfg, true, chainHandler)
				noopN, bareN, chainN = noopN+n, bareN+n, chainN+n
			}
			noop := float64(noopN) / noopTime.Seconds()
			bare := float64(bareN) / bareTime.Seconds()
			chain := float64(chainN) / chainTime.Seconds()
			b.ReportMetric(noop, "noop_msgs/s")
			b.ReportMetric(bare, "bare_msgs/s")
			b.ReportMetric(chain, "chain_msgs/s")
			b.ReportMetric(chain/bare, "chain/bare")
		})
	}
}

// consumeTime publishes n events to a fresh topic and returns how long a
// consumer took to process them, from the first handler call to the last
// one. withChain wraps the handler in millrace's chain.
func consumeTime(b *testing.B, k *kit, e *env, variant string, n int, cfg middleware.Config, withChain bool, handle func(*message.Message) error) time.Duration {
	b.Helper()
	b.StopTimer()
	topic, group := uniqueName(b, variant), uniqueName(b, variant+"_g")
	k.provision(b, topic, group)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("%s-%s-%d", variant, topic, i), fmt.Sprintf("o-%d", i%64), 1, `{"amount":1}`)
	}
	publish(b, k.pub, topic, msgs...)

	stack, err := middleware.New(cfg, middleware.Deps{DB: e.db, Schema: e.schema, Registerer: prometheus.NewRegistry()})
	require.NoError(b, err)
	chain, err := stack.Chain(middleware.Handler{Name: variant, Topic: topic, ConsumerGroup: group})
	require.NoError(b, err)
	var started atomic.Int64
	var done atomic.Int64
	finished := make(chan struct{})
	counted := func(msg *message.Message) error {
		started.CompareAndSwap(0, time.Now().UnixNano())
		if err := handle(msg); err != nil {
			return err
		}
		if done.Add(1) == int64(n) {
			close(finished)
		}
		return nil
	}
	h := counted
	if withChain {
		h = chain.Wrap(counted)
	}
	router, err := message.NewRouter(message.RouterConfig{}, testLogger())
	require.NoError(b, err)
	router.AddConsumerHandler(variant, topic, chain.Subscriber(k.source(group)), h)
	go func() { _ = router.Run(context.Background()) }()
	b.StartTimer()
	select {
	case <-finished:
	case <-time.After(5 * time.Minute):
		b.Fatalf("%s: %d of %d processed", variant, done.Load(), n)
	}
	elapsed := time.Since(time.Unix(0, started.Load()))
	b.StopTimer()
	require.NoError(b, router.Close())
	b.StartTimer()
	return elapsed
}
