package middleware_test

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testkit/child"
	"github.com/millrace-io/millrace/middleware"
)

// chainOn builds one handler's chain on e with cfg and returns it wrapped
// around handle, with the registry of its metrics.
func chainOn(t *testing.T, e *env, cfg middleware.Config, handle message.NoPublishHandlerFunc) (message.NoPublishHandlerFunc, *testConsumer) {
	t.Helper()
	reg := prometheus.NewRegistry()
	stack, err := middleware.New(cfg, middleware.Deps{DB: e.db, Schema: e.schema, Registerer: reg, Logger: testLogger()})
	require.NoError(t, err)
	chain, err := stack.Chain(middleware.Handler{Name: "billing", Topic: "orders", ConsumerGroup: "billing"})
	require.NoError(t, err)
	return chain.Wrap(handle), &testConsumer{reg: reg}
}

// forEachBatchSize runs test with one transaction per message and with
// batched inbox transactions (batch.max_messages 8).
func forEachBatchSize(t *testing.T, test func(*testing.T, middleware.Config)) {
	for _, size := range []int{1, 8} {
		t.Run(fmt.Sprintf("batch%d", size), func(t *testing.T) {
			t.Parallel()
			test(t, middleware.Config{Batch: middleware.BatchConfig{MaxMessages: size}})
		})
	}
}

func (c *testConsumer) abandoned(t testing.TB) (total, running float64) {
	labels := map[string]string{"handler": "billing"}
	return c.metric(t, middleware.MetricAbandoned, labels), c.metric(t, middleware.MetricAbandonedActive, labels)
}

// A handler that ignores its context is abandoned at handler_timeout: each
// abandoned attempt is a failed attempt of its message, the message is
// poisoned after retry.max_attempts with a reason that says so, and the
// chain is free for the next message at once. The abandoned goroutines keep
// using their message (metadata, context, transaction) while the next
// attempts and the poison queue work on it, and finish later: the race
// detector checks that they share nothing, and their writes never commit.
func TestAbandonedAttemptsArePoisonedAndNeverCommit(t *testing.T) {
	t.Parallel()
	forEachBatchSize(t, abandonedAttemptsArePoisonedAndNeverCommit)
}

func abandonedAttemptsArePoisonedAndNeverCommit(t *testing.T, cfg middleware.Config) {
	e := newEnv(t)
	cfg.HandlerTimeout = 300 * time.Millisecond
	fastRetry(&cfg, 3)

	var released atomic.Bool
	var calls attemptCounter
	var late sync.WaitGroup // the stuck handlers, until they return
	lateErrs := make(chan error, 3)
	handle, c := chainOn(t, e, cfg, func(msg *message.Message) error {
		id := msg.Metadata.Get(bus.EventIDKey)
		calls.next(id)
		if err := e.write(msg.Context(), "billing", msg); err != nil {
			return err
		}
		if id != "stuck" {
			return nil
		}
		defer late.Done()
		// Blocks regardless of its context, touching its message all along.
		for !released.Load() {
			msg.Metadata.Set("handler-note", "still here")
			_ = msg.Metadata.Get(middleware.PoisonReasonKey)
			_ = msg.Context().Err()
			time.Sleep(5 * time.Millisecond)
		}
		// Woken long after the attempt was abandoned: its transaction is
		// gone, and the chain would refuse to commit it anyway.
		err := e.write(msg.Context(), "billing", msg)
		lateErrs <- err
		return err
	})

	late.Add(3) // the stuck attempts
	require.NoError(t, handle(event("stuck", "o-1", 1, `{}`)), "poisoned and acked")
	require.Equal(t, 3, calls.get("stuck"), "every attempt ran, each abandoned")
	total, running := c.abandoned(t)
	require.EqualValues(t, 3, total)
	require.EqualValues(t, 3, running, "the abandoned handlers are still blocked")
	require.EqualValues(t, 1, c.messages(t, "billing", middleware.OutcomePoisoned))
	require.EqualValues(t, 2, c.messages(t, "billing", middleware.OutcomeRetried))
	row, ok := e.poisoned(t)["stuck"]
	require.True(t, ok)
	require.Equal(t, 3, row.attempts, "attempts == retry.max_attempts")
	require.Equal(t, middleware.ClassTransient, row.class)
	require.Contains(t, row.reason, "3 attempts failed, last: attempt abandoned after handler_timeout (300ms)")
	require.NotContains(t, row.metadata, "handler-note", "the poisoned message is the delivered one, not an attempt's copy")

	// The chain is not held by them: the next message is processed.
	require.NoError(t, handle(event("next", "o-2", 1, `{}`)))
	require.EqualValues(t, 1, c.messages(t, "billing", middleware.OutcomeOK))

	released.Store(true)
	late.Wait()
	for range 3 {
		err := <-lateErrs
		require.True(t, errors.Is(err, sql.ErrTxDone) || errors.Is(err, context.DeadlineExceeded),
			"a woken handler finds its transaction gone: %v", err)
	}
	testkit.Eventually(t, 30*time.Second, "the abandoned attempts reported their end", func() bool {
		_, running := c.abandoned(t)
		return running == 0
	})
	require.Zero(t, e.rows(t, "business", `event_id = 'stuck'`), "no write of an abandoned attempt committed")
	require.Zero(t, e.rows(t, "millrace_inbox", `event_id = 'stuck'`))
	require.Equal(t, 1, e.rows(t, "business", `event_id = 'next'`))
}

// The one window in which an abandoned attempt can still commit: its COMMIT
// was sent before handler_timeout and the server carries it out after. Here
// a deferred trigger makes the COMMIT outlast the timeout and ignores the
// cancel request pgx sends at the deadline, as a COMMIT past its point of no
// return does (one waiting for a synchronous standby, or whose answer was
// lost). The inbox row commits with the business write, so the retry finds
// it and acks the message as a duplicate without calling the handler: one
// effect.
func TestLateCommitOfAnAbandonedAttemptMakesTheRetryADuplicate(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, err := e.db.Exec(`
CREATE FUNCTION ` + e.table("slow_commit") + `() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
	until timestamptz := clock_timestamp() + interval '1.5 seconds';
BEGIN
	WHILE clock_timestamp() < until LOOP
		BEGIN
			PERFORM pg_sleep(0.05);
		EXCEPTION WHEN query_canceled THEN
			-- the cancel at the deadline does not stop this COMMIT
		END;
	END LOOP;
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ` + e.table("business") + `
	DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ` + e.table("slow_commit") + `()`)
	require.NoError(t, err)

	var cfg middleware.Config
	cfg.HandlerTimeout = time.Second
	fastRetry(&cfg, 5)
	cfg.Breaker.Enabled = new(false)
	var calls atomic.Int32
	handle, c := chainOn(t, e, cfg, func(msg *message.Message) error {
		calls.Add(1)
		// Returns at once; the COMMIT after it outlasts handler_timeout.
		return e.write(msg.Context(), "billing", msg)
	})
	require.NoError(t, handle(event("slow", "o-1", 1, `{}`)))

	require.EqualValues(t, 1, calls.Load(), "the handler ran once")
	require.GreaterOrEqual(t, c.messages(t, "billing", middleware.OutcomeRetried), 1.0, "the first attempt did not succeed in time")
	require.EqualValues(t, 1, c.messages(t, "billing", middleware.OutcomeDuplicate), "its late commit made the retry a duplicate")
	require.Zero(t, c.messages(t, "billing", middleware.OutcomePoisoned))
	require.Equal(t, 1, e.rows(t, "business", `event_id = 'slow'`), "one effect")
}

// A stop never poisons: an attempt running when the consumer stops keeps
// going until handler_timeout, and when it is abandoned then, the message
// is returned for redelivery, even though it was its last attempt.
func TestAbandonedAttemptDuringAStopIsNacked(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var cfg middleware.Config
	cfg.HandlerTimeout = 300 * time.Millisecond
	fastRetry(&cfg, 1)
	release := make(chan struct{})
	defer close(release)
	ctx, stop := context.WithCancel(context.Background())
	handle, c := chainOn(t, e, cfg, func(msg *message.Message) error {
		stop() // the consumer stops during the only attempt
		<-release
		return nil
	})
	msg := event("stuck", "o-1", 1, `{}`)
	msg.SetContext(ctx)
	err := handle(msg)
	require.ErrorContains(t, err, "consumer stopping, message returned for redelivery")
	require.True(t, strings.Contains(err.Error(), "abandoned after handler_timeout"), err.Error())
	total, _ := c.abandoned(t)
	require.EqualValues(t, 1, total)
	require.EqualValues(t, 1, c.messages(t, "billing", middleware.OutcomeNacked))
	require.Zero(t, c.messages(t, "billing", middleware.OutcomePoisoned))
	require.Empty(t, e.poisoned(t))
}

// Abandoned attempts of several messages open the breaker, but are never
// taken for an outage: each still uses up an attempt of its message, so the
// messages are poisoned after retry.max_attempts instead of being held (and
// adding a stuck goroutine at every trial) for as long as the hang lasts.
func TestAbandonedAttemptsOpenTheBreakerButAreNoOutage(t *testing.T) {
	t.Parallel()
	forEachBatchSize(t, func(t *testing.T, cfg middleware.Config) {
		timedOutAttemptsOpenTheBreakerButAreNoOutage(t, cfg, false)
	})
}

// So do attempts whose handler honours its context and returns its error
// at handler_timeout.
func TestTimedOutAttemptsOpenTheBreakerButAreNoOutage(t *testing.T) {
	t.Parallel()
	forEachBatchSize(t, func(t *testing.T, cfg middleware.Config) {
		timedOutAttemptsOpenTheBreakerButAreNoOutage(t, cfg, true)
	})
}

func timedOutAttemptsOpenTheBreakerButAreNoOutage(t *testing.T, cfg middleware.Config, honoursContext bool) {
	e := newEnv(t)
	cfg.HandlerTimeout = 200 * time.Millisecond
	fastRetry(&cfg, 3)
	cfg.Breaker = middleware.BreakerConfig{ConsecutiveFailures: 2, OpenTimeout: 50 * time.Millisecond}
	release := make(chan struct{})
	defer close(release)
	var calls attemptCounter
	handle, c := chainOn(t, e, cfg, func(msg *message.Message) error {
		calls.next(msg.Metadata.Get(bus.EventIDKey))
		if honoursContext {
			<-msg.Context().Done()
			return msg.Context().Err()
		}
		<-release
		return nil
	})
	var wg sync.WaitGroup
	for _, id := range []string{"stuck-1", "stuck-2"} {
		wg.Go(func() {
			if err := handle(event(id, "o-"+id, 1, `{}`)); err != nil {
				t.Errorf("%s: %v", id, err)
			}
		})
	}
	wg.Wait()
	poisoned := e.poisoned(t)
	for _, id := range []string{"stuck-1", "stuck-2"} {
		require.Equal(t, 3, poisoned[id].attempts, id)
		// An attempt may end at handler_timeout before it reaches the
		// handler: on a loaded machine its inbox statements (or, batched,
		// the wait for its turn) can outlast the 200ms. It is a failed
		// attempt all the same.
		require.GreaterOrEqual(t, calls.get(id), 1, id)
		require.LessOrEqual(t, calls.get(id), 3, id)
	}
	require.NotEqualValues(t, middleware.BreakerClosed,
		c.metric(t, middleware.MetricBreakerState, map[string]string{"handler": "billing"}), "the abandoned attempts opened the breaker")
}

// Stopping the consumer is not a failure: a message waiting for its next
// retry is nacked, never poisoned, and comes back to the next consumer; an
// attempt already running finishes and commits before Close returns, and is
// acked before the subscriptions close.
func TestShutdownNacksWaitingMessagesAndDrainsRunningOnes(t *testing.T) {
	t.Parallel()
	testkit.Each(t, []string{bus.KindKafka, bus.KindNATS, bus.KindRabbitMQ}, func(t *testing.T, name string) {
		e, k, topic, group := newBilling(t, name, kitOptions{ackWait: 2 * time.Second})

		slowStarted := make(chan struct{})
		var failures atomic.Int64
		first := func(msg *message.Message) error {
			switch msg.Metadata.Get(bus.EventIDKey) {
			case "slow":
				close(slowStarted)
				time.Sleep(time.Second) // still running when the consumer stops
			case "failing":
				failures.Add(1)
				return errors.New("ledger unavailable")
			}
			return e.write(msg.Context(), group, msg)
		}
		cfg := middleware.Config{Workers: 2}
		cfg.Retry = middleware.RetryConfig{InitialInterval: time.Minute, MaxInterval: time.Minute, MaxElapsed: time.Hour}
		publish(t, k.pub, topic, event("slow", "o-1", 1, `{}`), event("failing", "o-2", 1, `{}`))
		c1 := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: first})
		<-slowStarted
		testkit.Eventually(t, 30*time.Second, "the failing message waits for its retry", func() bool {
			return c1.messages(t, "billing", middleware.OutcomeRetried) == 1
		})
		c1.close(t)

		require.Equal(t, 1, e.rows(t, "business", `event_id = 'slow'`),
			"the running attempt finished and committed")
		require.EqualValues(t, 1, c1.messages(t, "billing", middleware.OutcomeOK))
		require.EqualValues(t, 1, c1.messages(t, "billing", middleware.OutcomeNacked))
		require.Zero(t, c1.messages(t, "billing", middleware.OutcomePoisoned))
		require.EqualValues(t, 1, failures.Load(), "no retry ran after the stop")

		c2 := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group,
			handle: func(msg *message.Message) error { return e.write(msg.Context(), group, msg) }})
		testkit.Eventually(t, 30*time.Second, "the nacked message processed by the next consumer", func() bool {
			return c2.messages(t, "billing", middleware.OutcomeOK) == 1
		})
		// Had the slow message's ack been lost, it would come back within
		// the 2s ack wait; the inbox must absorb it.
		time.Sleep(3 * time.Second)
		t.Logf("duplicates after the restart: %v", c2.messages(t, "billing", middleware.OutcomeDuplicate))
		require.Equal(t, 2, e.rows(t, "business", ""), "one effect per event")
		require.Zero(t, e.rows(t, "millrace_poison", ""))
	})
}

// The crash tests run a consumer in a child process (this test binary run
// again with MILLRACE_CRASH_* set), kill it with SIGKILL at a chosen point,
// then run a clean consumer on the same consumer group: no event may be
// lost and none may have two effects.
const (
	crashRole    = "crash-consumer"
	crashReady   = "MILLRACE_CRASH_READY"   // followed by the victim and its batch mates
	crashStarted = "MILLRACE_CRASH_STARTED" // the child's subscriptions are open
	// Points where the child is killed.
	beforeCommit = "before-commit" // the victim's business row written, not committed
	afterCommit  = "after-commit"  // the victim committed, not acked
)

// TestCrashRecovery kills the child with one transaction per message and,
// under batched/, with batched inbox transactions (batch.max_messages 8):
// there the victim is the first message run in a batch after another one
// (found by the transaction it runs in), so the kill lands mid-batch, before
// the COMMIT (the mates' writes are lost with it) or after it (the mates'
// and the victim's writes are committed, their acks not all sent).
func TestCrashRecovery(t *testing.T) {
	if child.Role() == crashRole {
		crashChild(t)
		return
	}
	t.Parallel()
	for _, batched := range []bool{false, true} {
		for _, broker := range []string{bus.KindKafka, bus.KindNATS, bus.KindRabbitMQ} {
			for _, mode := range []string{beforeCommit, afterCommit} {
				name := broker + "/" + mode
				if batched {
					name = "batched/" + name
				}
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					testCrash(t, broker, mode, batched)
				})
			}
		}
	}
}

// crashBatch is the child's batch setting when batched. A batch waits for
// its messages, up to 5s (see crashChild).
var crashBatch = middleware.Config{Workers: 8, Batch: middleware.BatchConfig{MaxMessages: 8, MaxWait: 5 * time.Second}}

func testCrash(t *testing.T, broker, mode string, batched bool) {
	const events = 30
	// NATS redelivers what the dead child held after ackWait.
	e, k, topic, group := newBilling(t, broker, kitOptions{ackWait: 2 * time.Second})
	msgs := make([]*message.Message, events)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("evt-%02d", i), fmt.Sprintf("o-%d", i%5), int64(i/5+1), `{"amount":1}`)
		if batched { // an aggregate each: spread over every Kafka partition
			msgs[i] = event(fmt.Sprintf("evt-%02d", i), fmt.Sprintf("o-%d", i), 1, `{"amount":1}`)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	env := []string{"MILLRACE_CRASH_MODE=" + mode, "MILLRACE_CRASH_BROKER=" + broker, "MILLRACE_CRASH_SCHEMA=" + e.schema,
		"MILLRACE_CRASH_TOPIC=" + topic, "MILLRACE_CRASH_GROUP=" + group, "MILLRACE_CRASH_BATCHED=" + strconv.FormatBool(batched)}
	if broker == bus.KindKafka { // the child reaches the parent's in-process cluster
		env = append(env, "KAFKA_BROKERS="+strings.Join(brokertest.KafkaBrokers(t), ","))
	}
	proc, started, ready := startCrashChild(t, env)
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("the child consumer never started")
	}
	// Published once the child's subscriptions are open: a NATS push
	// consumer gives a backlog waiting at the start to the first one.
	publish(t, k.pub, topic, msgs...)
	var victim string
	var mates []string // run before the victim in its batch
	select {
	case got := <-ready:
		victim, mates = got[0], got[1:]
	case <-ctx.Done():
		t.Fatal("the child consumer never reached the crash point")
	}
	if batched {
		require.NotEmpty(t, mates, "the victim ran in a batch after other messages")
	}
	checkCrashPoint(t, e, mode, victim, mates)
	proc.Kill()
	recoverFromCrash(t, k, e, mode, batched, topic, group, victim, events)
}

// startCrashChild starts the child consumer with env. started is closed
// once its subscriptions are open; ready gets the victim and its batch
// mates once it reaches the crash point.
func startCrashChild(t *testing.T, env []string) (proc *child.Process, started <-chan struct{}, ready <-chan []string) {
	stdout, childOut := io.Pipe()
	proc = child.Start(t, child.Options{Role: crashRole, Run: "^TestCrashRecovery$", Env: env, Stdout: childOut})
	go func() { <-proc.Done(); childOut.Close() }()
	startedc, readyc := make(chan struct{}), make(chan []string, 1)
	go func() {
		scanner := bufio.NewScanner(stdout)
		for scanner.Scan() {
			fields := strings.Fields(scanner.Text())
			switch {
			case len(fields) == 1 && fields[0] == crashStarted:
				close(startedc)
				continue
			case len(fields) >= 2 && fields[0] == crashReady:
				readyc <- fields[1:]
			default:
				continue
			}
			break
		}
		for scanner.Scan() { // keep the pipe drained
		}
	}()
	return proc, startedc, readyc
}

// checkCrashPoint checks what the child has committed at the crash point
// of mode.
func checkCrashPoint(t *testing.T, e *env, mode, victim string, mates []string) {
	rowsOf := func(ids []string) int {
		return e.rows(t, "business", `event_id = ANY($1)`, ids)
	}
	victimRows := e.rows(t, "business", `event_id = $1`, victim)
	switch mode {
	case beforeCommit:
		require.Zero(t, victimRows, "the victim's write is not committed yet")
		require.Zero(t, rowsOf(mates), "nor are those of its batch mates")
	case afterCommit:
		require.Equal(t, 1, victimRows, "the victim's write is committed")
		require.Equal(t, 1, e.rows(t, "millrace_inbox", `event_id = $1`, victim))
		require.Equal(t, len(mates), rowsOf(mates), "and so are those of its batch mates")
	}
}

// recoverFromCrash runs a clean consumer on the killed child's group and
// checks that every one of the events is committed once.
func recoverFromCrash(t *testing.T, k *kit, e *env, mode string, batched bool, topic, group, victim string, events int) {
	// The child's other workers kept going until the kill: a COMMIT the
	// server received may still land after this count, and the clean
	// consumer then finds that event as a duplicate rather than ok.
	committedByChild := e.rows(t, "millrace_inbox", "")
	cfg := middleware.Config{}
	if batched {
		cfg = crashBatch
	}
	c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group,
		handle: func(msg *message.Message) error { return e.write(msg.Context(), group, msg) }})
	// The outcome of a message is counted after its COMMIT, once its
	// attempt has returned through the chain: the rows may be there first.
	handled := func() float64 {
		return c.messages(t, "billing", middleware.OutcomeOK) + c.messages(t, "billing", middleware.OutcomeDuplicate)
	}
	testkit.Eventually(t, 2*time.Minute, "every event committed once, by the child or the clean consumer", func() bool {
		return e.rows(t, "millrace_inbox", "") == events &&
			(mode != afterCommit || c.messages(t, "billing", middleware.OutcomeDuplicate) >= 1) &&
			handled() >= float64(events-committedByChild)
	})
	require.GreaterOrEqual(t, handled(), float64(events-committedByChild), "the clean consumer processed every event the child had not committed")
	require.Equal(t, events, e.rows(t, "business", ""), "no event has two effects")
	require.Equal(t, events, e.rows(t, "millrace_inbox", ""))
	require.Equal(t, 1, e.rows(t, "business", `event_id = $1`, victim))
	require.Zero(t, e.rows(t, "millrace_poison", ""))
	if mode == afterCommit {
		require.GreaterOrEqual(t, c.messages(t, "billing", middleware.OutcomeDuplicate), 1.0,
			"the committed but unacked victim came back and was recognised as a duplicate")
	}
}

// crashChild is the consumer the parent kills.
func crashChild(t *testing.T) {
	mode, batched := os.Getenv("MILLRACE_CRASH_MODE"), os.Getenv("MILLRACE_CRASH_BATCHED") == "true"
	group, topic := os.Getenv("MILLRACE_CRASH_GROUP"), os.Getenv("MILLRACE_CRASH_TOPIC")
	e := &env{db: testdb.Open(t), schema: os.Getenv("MILLRACE_CRASH_SCHEMA")}
	k := newKit(t, os.Getenv("MILLRACE_CRASH_BROKER"), kitOptions{ackWait: 2 * time.Second})
	v := &victimPicker{batched: batched, txOf: map[string]int64{}}
	// Batched, the first call waits until two more messages have entered the
	// chain: they gather in the next batch, which runs as soon as the first
	// call's batch is done and they have joined, so a victim is found there.
	var entered atomic.Int64
	gathered := make(chan struct{})
	var firstCall, gatheredOnce sync.Once
	spec := handlerSpec{name: "billing", topic: topic, group: group, handle: func(msg *message.Message) error {
		if batched {
			firstCall.Do(func() { <-gathered })
		}
		if err := e.write(msg.Context(), group, msg); err != nil {
			return err
		}
		if v.is(t, msg) && mode == beforeCommit {
			v.crash()
		}
		return nil
	}}
	// Outside the chain: it counts the messages entering it and, after
	// the commit, the router has not acked yet.
	spec.outer = func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if entered.Add(1) == 3 {
				gatheredOnce.Do(func() { close(gathered) })
			}
			out, err := h(msg)
			if mode == afterCommit && err == nil && v.chosenOne(msg) {
				v.crash()
			}
			return out, err
		}
	}
	cfg := middleware.Config{}
	if batched {
		cfg = crashBatch
	}
	startConsumer(t, k, e, cfg, spec)
	fmt.Println(crashStarted)
	select {}
}

// victimPicker picks the victim among the child handler's calls: evt-10,
// or, batched, the first message run in a transaction after another one.
type victimPicker struct {
	batched bool
	mu      sync.Mutex
	txOf    map[string]int64
	victim  string
	chosen  bool
	mates   []string
}

// is says whether msg is the victim, picking it when none is yet.
func (v *victimPicker) is(t *testing.T, msg *message.Message) bool {
	id := msg.Metadata.Get(bus.EventIDKey)
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.chosen {
		return id == v.victim
	}
	if !v.batched {
		v.chosen, v.victim = id == "evt-10", id
		return v.chosen
	}
	ctx := msg.Context()
	var txid int64
	require.NoError(t, middleware.Tx(ctx).QueryRowContext(ctx, `SELECT txid_current()`).Scan(&txid))
	for other, tx := range v.txOf {
		if tx == txid {
			v.mates = append(v.mates, other)
		}
	}
	v.txOf[id] = txid
	v.chosen, v.victim = len(v.mates) > 0, id
	return v.chosen
}

// chosenOne says whether msg is the victim picked already.
func (v *victimPicker) chosenOne(msg *message.Message) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.chosen && msg.Metadata.Get(bus.EventIDKey) == v.victim
}

// crash tells the parent the victim and its mates and waits for SIGKILL.
func (v *victimPicker) crash() {
	fmt.Println(strings.Join(append([]string{crashReady, v.victim}, v.mates...), " "))
	select {} // wait for SIGKILL
}
