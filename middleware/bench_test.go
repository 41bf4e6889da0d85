package middleware_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/middleware/consumer"
)

// BenchmarkConsumerThroughput consumes benchEvents events per iteration over
// one broker with each of these consumers, all on the same Dispatcher over
// the subscriber bus.Run would choose for the variant (so only the handler
// differs), and reports their rates in effects/s (one business row per
// event) side by side:
//
//   - noop: a bare Watermill handler that only acks (the broker's ceiling);
//   - bare: a bare Watermill handler doing the business write in its own
//     transaction, without inbox or middleware;
//   - chain1: the same write through millrace's full chain with the inbox
//     on, batch.max_messages 1 (one transaction and COMMIT per message);
//   - batched: the chain with batch.max_messages 8 and 8 workers;
//   - batched32: the chain with 32 workers and batch.max_messages 32;
//   - batched128x32: the chain with 128 workers and batch.max_messages 32
//     (four batches filling while others commit);
//   - batchhandler: the chain as batched, with a batch handler (WrapBatch)
//     writing each batch with one INSERT;
//   - batchhandler32x8: the batch handler with 32 workers and
//     batch.max_messages 8, so that batches fill while others commit;
//   - batchhandler128x32: the batch handler with 128 workers and batches
//     of 32, and chain1x64, batch size 1 with 64 workers (which shows what
//     workers alone give; 128 backends at once would exceed PostgreSQL's
//     default max_connections);
//
// then bare, chain1, batched, batched32, batchhandler, batchhandler128x32
// and chain1x64 again with every COMMIT taking 2ms more (the *_flush2ms
// rates), as one that waits for a disk flush or a synchronous standby
// does: the local PostgreSQL of the test machine commits about as fast as
// it runs a statement, which hides what batching saves. It reports the
// ratios batched/chain1, batched32/chain1, batched128x32/chain1,
// batchhandler/chain1, batchhandler/batched, batchhandler32x8/chain1,
// batchhandler128x32/chain1, batchhandler128x32/chain1x64, batched/bare
// and, with the slow COMMIT, batched/chain1_flush2ms,
// batched32/chain1_flush2ms, batchhandler/chain1_flush2ms,
// batchhandler128x32/chain1_flush2ms and
// batchhandler128x32/chain1x64_flush2ms, and the mean messages per batched
// transaction (msgs/tx). MILLRACE_BENCH_BROKERS picks the brokers (default
// gochannel, kafka, nats, rabbitmq).
func BenchmarkConsumerThroughput(b *testing.B) {
	for _, name := range benchBrokers() {
		b.Run(name, func(b *testing.B) {
			e := newEnv(b)
			e.db.SetMaxIdleConns(128) // keep the workers' connections instead of reopening them
			// NATS hands out as many as the widest consumer holds (128
			// workers, prefetch 256).
			k := newKit(b, name, kitOptions{maxAckPending: 256})
			variants := throughputVariants(e)
			// The machine is shared: the variants run in alternating rounds
			// so that a change of load affects them alike.
			const rounds = 3
			for range rounds {
				n := b.N * benchEvents / rounds
				for i := range variants {
					variants[i].consume(b, k, e, n)
				}
			}
			reportThroughput(b, variants)
		})
	}
}

// throughputVariants are the handlers and settings BenchmarkConsumerThroughput
// compares, those named in MILLRACE_BENCH_VARIANTS when it is set.
func throughputVariants(e *env) []benchVariant {
	noop := func(*message.Message) error { return nil }
	bare := func(flush time.Duration) func(*message.Message) error {
		return func(msg *message.Message) error {
			tx, err := e.db.BeginTx(msg.Context(), nil)
			if err != nil {
				return err
			}
			defer tx.Rollback() //nolint:errcheck // a no-op after Commit
			if _, err := tx.ExecContext(msg.Context(), `INSERT INTO `+e.table("business")+` (consumer_group, event_id, aggregate_id, version) VALUES ($1, $2, $3, 1)`,
				"bare", msg.Metadata.Get(bus.EventIDKey), msg.Metadata.Get(bus.AggregateIDKey)); err != nil {
				return err
			}
			return slowCommit{tx, flush}.Commit()
		}
	}
	// The chain's write goes through CurrentTx: with a slow COMMIT
	// the transaction is not a bare *sql.Tx.
	chained := func(msg *message.Message) error {
		ctx := msg.Context()
		_, err := middleware.CurrentTx(ctx).ExecContext(ctx, `INSERT INTO `+e.table("business")+` (consumer_group, event_id, aggregate_id, version) VALUES ($1, $2, $3, 1)`,
			"chain", msg.Metadata.Get(bus.EventIDKey), msg.Metadata.Get(bus.AggregateIDKey))
		return err
	}
	// The batch handler's write: one INSERT for the batch.
	bulk := func(ctx context.Context, msgs []*message.Message) error {
		ids, aggregates := make([]string, len(msgs)), make([]string, len(msgs))
		for i, msg := range msgs {
			ids[i], aggregates[i] = msg.Metadata.Get(bus.EventIDKey), msg.Metadata.Get(bus.AggregateIDKey)
		}
		_, err := middleware.CurrentTx(ctx).ExecContext(ctx, `INSERT INTO `+e.table("business")+` (consumer_group, event_id, aggregate_id, version) `+
			`SELECT 'chain', id, aggregate, 1 FROM unnest($1::text[], $2::text[]) AS u(id, aggregate)`, ids, aggregates)
		return err
	}
	const flush = 2 * time.Millisecond
	batch := func(workers, size int) middleware.Config {
		return middleware.Config{Workers: workers, Batch: middleware.BatchConfig{MaxMessages: size}}
	}
	variants := []benchVariant{
		{name: "noop", cfg: batch(8, 1), handle: noop},
		{name: "bare", cfg: batch(8, 1), handle: bare(0)},
		{name: "chain1", cfg: batch(8, 1), chain: true, handle: chained},
		{name: "batched", cfg: batch(8, 8), chain: true, handle: chained},
		{name: "batched32", cfg: batch(32, 32), chain: true, handle: chained},
		{name: "batched128x32", cfg: batch(128, 32), chain: true, handle: chained},
		{name: "batchhandler", cfg: batch(8, 8), chain: true, batch: bulk},
		{name: "batchhandler32x8", cfg: batch(32, 8), chain: true, batch: bulk},
		{name: "batchhandler128x32", cfg: batch(128, 32), chain: true, batch: bulk},
		{name: "chain1x64", cfg: batch(64, 1), chain: true, handle: chained},
		{name: "bare_flush2ms", cfg: batch(8, 1), handle: bare(flush)},
		{name: "chain1_flush2ms", cfg: batch(8, 1), chain: true, flush: flush, handle: chained},
		{name: "batched_flush2ms", cfg: batch(8, 8), chain: true, flush: flush, handle: chained},
		{name: "batched32_flush2ms", cfg: batch(32, 32), chain: true, flush: flush, handle: chained},
		{name: "batchhandler_flush2ms", cfg: batch(8, 8), chain: true, flush: flush, batch: bulk},
		{name: "batchhandler128x32_flush2ms", cfg: batch(128, 32), chain: true, flush: flush, batch: bulk},
		{name: "chain1x64_flush2ms", cfg: batch(64, 1), chain: true, flush: flush, handle: chained},
	}
	if v := os.Getenv("MILLRACE_BENCH_VARIANTS"); v != "" {
		names := strings.Split(v, ",")
		variants = slices.DeleteFunc(variants, func(v benchVariant) bool { return !slices.Contains(names, v.name) })
	}
	return variants
}

// reportThroughput reports each variant's effects per second, its
// messages per batched transaction, and the ratios of pairs of variants.
func reportThroughput(b *testing.B, variants []benchVariant) {
	rate := map[string]float64{}
	for _, v := range variants {
		rate[v.name] = float64(v.count) / v.elapsed.Seconds()
		b.ReportMetric(rate[v.name], v.name+"_effects/s")
		if v.cfg.Batch.MaxMessages > 1 && v.transactions > 0 {
			b.ReportMetric(float64(v.count)/v.transactions, v.name+"_msgs/tx")
		}
	}
	for _, r := range [][2]string{
		{"batched", "chain1"}, {"batched32", "chain1"}, {"batched128x32", "chain1"}, {"batchhandler", "chain1"}, {"batchhandler", "batched"},
		{"batchhandler32x8", "chain1"}, {"batchhandler128x32", "chain1"}, {"batchhandler128x32", "chain1x64"}, {"batched", "bare"},
		{"batched_flush2ms", "chain1_flush2ms"}, {"batched32_flush2ms", "chain1_flush2ms"}, {"batchhandler_flush2ms", "chain1_flush2ms"},
		{"batchhandler128x32_flush2ms", "chain1_flush2ms"}, {"batchhandler128x32_flush2ms", "chain1x64_flush2ms"},
	} {
		if rate[r[0]] > 0 && rate[r[1]] > 0 {
			b.ReportMetric(rate[r[0]]/rate[r[1]], strings.TrimSuffix(r[0], "_flush2ms")+"/"+r[1])
		}
	}
}

// benchBrokers are the kits the benchmarks run on: MILLRACE_BENCH_BROKERS
// (comma-separated), or every one.
func benchBrokers() []string {
	if v := os.Getenv("MILLRACE_BENCH_BROKERS"); v != "" {
		return strings.Split(v, ",")
	}
	return kitNames
}

// benchEvents is how many events each consumer of BenchmarkConsumerThroughput
// handles per iteration, in three rounds: a fixed workload, since one with
// b.N events would be a handful on the brokers (a consumer's start takes
// longer than the default benchtime) and never fill a batch.
const benchEvents = 6000

// slowCommit is a transaction whose COMMIT takes flush longer, as one
// waiting for a disk flush does (sleeping after it: the server is done,
// the client still waits).
type slowCommit struct {
	*sql.Tx
	flush time.Duration
}

func (t slowCommit) Commit() error {
	err := t.Tx.Commit()
	time.Sleep(t.flush)
	return err
}

// benchVariant is one consumer of BenchmarkConsumerThroughput and what it
// measured.
type benchVariant struct {
	name   string
	cfg    middleware.Config
	chain  bool          // wrap handle in millrace's chain
	flush  time.Duration // added to every COMMIT of the chain
	handle func(*message.Message) error
	// batch, when set, is the handler instead of handle (a batch handler).
	batch middleware.BatchHandlerFunc

	elapsed      time.Duration
	count        int
	transactions float64 // batched inbox transactions
}

// consume publishes n events to a fresh topic and adds how long a consumer
// took to process them, from the first handler call to the last one.
func (v *benchVariant) consume(b *testing.B, k *kit, e *env, n int) {
	b.Helper()
	b.StopTimer()
	topic, group := uniqueName(b, v.name), uniqueName(b, v.name+"_g")
	k.provision(b, topic, group)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("%s-%s-%d", v.name, topic, i), fmt.Sprintf("o-%d", i%64), 1, `{"amount":1}`)
	}
	publish(b, k.pub, topic, msgs...)

	reg := prometheus.NewRegistry()
	deps := middleware.Deps{DB: e.db, Schema: e.schema, Registerer: reg}
	if v.flush > 0 {
		deps.BeginTx = func(ctx context.Context) (middleware.Transaction, error) {
			tx, err := e.db.BeginTx(ctx, nil)
			return slowCommit{tx, v.flush}, err
		}
	}
	stack, err := middleware.New(v.cfg, deps)
	require.NoError(b, err)
	chain, err := stack.Chain(middleware.Handler{Name: v.name, Topic: topic, ConsumerGroup: group})
	require.NoError(b, err)
	var started atomic.Int64
	var done atomic.Int64
	finished := make(chan struct{})
	count := func(handled int) {
		if now := done.Add(int64(handled)); now >= int64(n) && now-int64(handled) < int64(n) {
			close(finished)
		}
	}
	counted := func(msg *message.Message) error {
		started.CompareAndSwap(0, time.Now().UnixNano())
		if err := v.handle(msg); err != nil {
			return err
		}
		count(1)
		return nil
	}
	h := counted
	switch {
	case v.batch != nil:
		h = chain.WrapBatch(func(ctx context.Context, msgs []*message.Message) error {
			started.CompareAndSwap(0, time.Now().UnixNano())
			if err := v.batch(ctx, msgs); err != nil {
				return err
			}
			count(len(msgs))
			return nil
		})
	case v.chain:
		h = chain.Wrap(counted)
	}
	router, err := message.NewRouter(message.RouterConfig{}, testLogger())
	require.NoError(b, err)
	router.AddConsumerHandler(v.name, topic, consumer.Subscriber(chain, k.sourceFor(chain, group)), h)
	go func() { _ = router.Run(context.Background()) }()
	b.StartTimer()
	select {
	case <-finished:
	case <-time.After(5 * time.Minute):
		b.Fatalf("%s: %d of %d processed", v.name, done.Load(), n)
	}
	v.elapsed += time.Since(time.Unix(0, started.Load()))
	v.count += n
	b.StopTimer()
	require.NoError(b, router.Close())
	families, err := reg.Gather()
	require.NoError(b, err)
	for _, f := range families {
		if f.GetName() == middleware.MetricBatchSize {
			for _, m := range f.GetMetric() {
				v.transactions += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	b.StartTimer()
}

// BenchmarkConsumerEventAge publishes trickleEvents events one at a time at
// 200 events/s to each consumer in turn, and reports the p50 and p99 of
// their age when the consumer is done with them, from before the publish
// to the return of the chain (the inbox transaction committed, the ack
// next), in ms: chain1 (batch size 1), batched (batch.max_messages 8,
// max_wait 2ms) and batchhandler128x32 (the batch handler, 128 workers,
// batches of 32), per broker, with p99 of each batched consumer minus p99
// of chain1 (the promise: at a trickle a batch waits at most max_wait).
// MILLRACE_BENCH_BROKERS picks the brokers.
func BenchmarkConsumerEventAge(b *testing.B) {
	for _, name := range benchBrokers() {
		b.Run(name, func(b *testing.B) {
			e := newEnv(b)
			e.db.SetMaxIdleConns(128)
			k := newKit(b, name, kitOptions{maxAckPending: 128})
			write := func(ctx context.Context, msg *message.Message) error {
				_, err := middleware.CurrentTx(ctx).ExecContext(ctx, `INSERT INTO `+e.table("business")+` (consumer_group, event_id, aggregate_id, version) VALUES ($1, $2, $3, 1)`,
					"chain", msg.Metadata.Get(bus.EventIDKey), msg.Metadata.Get(bus.AggregateIDKey))
				return err
			}
			batch := func(workers, size int) middleware.Config {
				return middleware.Config{Workers: workers, Batch: middleware.BatchConfig{MaxMessages: size, MaxWait: 2 * time.Millisecond}}
			}
			variants := []struct {
				name  string
				cfg   middleware.Config
				batch bool
			}{
				{"chain1", batch(8, 1), false},
				{"batched", batch(8, 8), false},
				{"batchhandler128x32", batch(128, 32), true},
			}
			p99 := map[string]float64{}
			for range b.N {
				for _, v := range variants {
					ages := trickle(b, k, e, v.name, v.cfg, v.batch, write)
					slices.Sort(ages)
					p50, p := ages[len(ages)/2], ages[len(ages)*99/100]
					b.ReportMetric(float64(p50)/1e6, v.name+"_p50_ms")
					b.ReportMetric(float64(p)/1e6, v.name+"_p99_ms")
					p99[v.name] = float64(p) / 1e6
				}
			}
			b.ReportMetric(p99["batched"]-p99["chain1"], "batched-chain1_p99_ms")
			b.ReportMetric(p99["batchhandler128x32"]-p99["chain1"], "batchhandler128x32-chain1_p99_ms")
		})
	}
}

// trickleEvents is how many events BenchmarkConsumerEventAge publishes per
// consumer: 5s at 200/s.
const trickleEvents = 1000

// trickle runs a consumer named name with cfg whose handler does write
// (in a batch handler when batched), publishes trickleEvents events to it
// at 200/s and returns each one's age when the chain returned.
func trickle(b *testing.B, k *kit, e *env, name string, cfg middleware.Config, batched bool, write func(context.Context, *message.Message) error) []time.Duration {
	b.Helper()
	b.StopTimer()
	defer b.StartTimer()
	topic, group := uniqueName(b, name+"_age"), uniqueName(b, name+"_age_g")
	k.provision(b, topic, group)
	stack, err := middleware.New(cfg, middleware.Deps{DB: e.db, Schema: e.schema, Registerer: prometheus.NewRegistry()})
	require.NoError(b, err)
	chain, err := stack.Chain(middleware.Handler{Name: name, Topic: topic, ConsumerGroup: group})
	require.NoError(b, err)
	var h message.NoPublishHandlerFunc
	if batched {
		h = chain.WrapBatch(func(ctx context.Context, msgs []*message.Message) error {
			for _, msg := range msgs {
				if err := write(ctx, msg); err != nil {
					return err
				}
			}
			return nil
		})
	} else {
		h = chain.Wrap(func(msg *message.Message) error { return write(msg.Context(), msg) })
	}
	var mu sync.Mutex
	published := map[string]time.Time{}
	var ages []time.Duration
	done := make(chan struct{})
	warm := make(chan struct{})
	aged := func(msg *message.Message) error {
		err := h(msg)
		if err == nil {
			mu.Lock()
			if msg.UUID == "warm-up" {
				close(warm)
			}
			if at, ok := published[msg.UUID]; ok {
				delete(published, msg.UUID)
				ages = append(ages, time.Since(at))
				if len(ages) == trickleEvents {
					close(done)
				}
			}
			mu.Unlock()
		}
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, testLogger())
	require.NoError(b, err)
	router.AddConsumerHandler(name, topic, consumer.Subscriber(chain, k.sourceFor(chain, group)), aged)
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	defer func() { require.NoError(b, router.Close()) }()
	// Timed from the first event the consumer had a chance to take, not
	// from a Kafka group join.
	require.NoError(b, k.pub.Publish(topic, event("warm-up", "o-warm", 1, `{"amount":1}`)))
	select {
	case <-warm:
	case <-time.After(time.Minute):
		b.Fatalf("%s: the warm-up event was not handled", name)
	}
	tick := time.NewTicker(time.Second / 200)
	defer tick.Stop()
	for i := range trickleEvents {
		<-tick.C
		msg := event(fmt.Sprintf("%s-%s-%d", name, topic, i), fmt.Sprintf("o-%d", i%64), 1, `{"amount":1}`)
		mu.Lock()
		published[msg.UUID] = time.Now()
		mu.Unlock()
		require.NoError(b, k.pub.Publish(topic, msg))
	}
	select {
	case <-done:
	case <-time.After(time.Minute):
		b.Fatalf("%s: %d of %d events handled", name, len(ages), trickleEvents)
	}
	mu.Lock()
	defer mu.Unlock()
	return slices.Clone(ages)
}
