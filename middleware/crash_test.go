package middleware_test

import (
	"bufio"
	"context"
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
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testkit/child"
	"github.com/millrace-io/millrace/middleware"
)

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
