package middleware_test

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/brokertest"
	"github.com/millrace-io/millrace/internal/testdb"
	"github.com/millrace-io/millrace/internal/testkit"
	"github.com/millrace-io/millrace/internal/testkit/child"
	"github.com/millrace-io/millrace/middleware"
)

// The crash tests run a consumer in a child process (this test binary run
// again as child role crashRole, with MILLRACE_CRASH_* set), kill it with
// SIGKILL at a chosen point, then run a clean consumer on the same consumer
// group: no event may be lost and none may have two effects.
const (
	crashRole = "crash-consumer"
	// Points where the child is killed.
	beforeCommit = "before-commit" // the victim's business row written, not committed
	afterCommit  = "after-commit"  // the victim committed, not acked
)

func TestCrashRecovery(t *testing.T) {
	if child.Role() == crashRole {
		crashChild(t)
		return
	}
	t.Parallel()
	for _, broker := range []string{bus.KindKafka, bus.KindNATS, bus.KindRabbitMQ} {
		for _, mode := range []string{beforeCommit, afterCommit} {
			t.Run(broker+"/"+mode, func(t *testing.T) {
				t.Parallel()
				testCrash(t, broker, mode)
			})
		}
	}
}

func testCrash(t *testing.T, broker, mode string) {
	const events = 30
	const victim = "evt-10"
	e := newEnv(t)
	opts := kitOptions{ackWait: 2 * time.Second} // NATS redelivers what the dead child held after this
	k := newKit(t, broker, opts)
	topic, group := uniqueName(t, "orders"), uniqueName(t, "billing")
	k.provision(t, topic, group)
	msgs := make([]*message.Message, events)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("evt-%02d", i), fmt.Sprintf("o-%d", i%5), int64(i/5+1), `{"amount":1}`)
	}
	publish(t, k.pub, topic, msgs...)

	env := []string{"MILLRACE_CRASH_MODE=" + mode, "MILLRACE_CRASH_BROKER=" + broker, "MILLRACE_CRASH_SCHEMA=" + e.schema,
		"MILLRACE_CRASH_TOPIC=" + topic, "MILLRACE_CRASH_GROUP=" + group, "MILLRACE_CRASH_VICTIM=" + victim}
	if broker == bus.KindKafka { // the child reaches the parent's in-process cluster
		env = append(env, "KAFKA_BROKERS="+strings.Join(brokertest.KafkaBrokers(t), ","))
	}
	proc := child.Start(t, child.Options{Role: crashRole, Run: "^TestCrashRecovery$", Env: env})
	proc.WaitReady(2 * time.Minute)

	victimRows := func() int {
		return e.count(t, `SELECT count(*) FROM `+e.table("business")+` WHERE event_id = $1`, victim)
	}
	switch mode {
	case beforeCommit:
		require.Zero(t, victimRows(), "the victim's write is not committed yet")
	case afterCommit:
		require.Equal(t, 1, victimRows(), "the victim's write is committed")
		require.Equal(t, 1, e.count(t, `SELECT count(*) FROM `+e.table("millrace_inbox")+` WHERE event_id = $1`, victim))
	}
	proc.Kill()

	// The child's other workers kept going until the kill: a COMMIT the
	// server received may still land after this count, and the clean
	// consumer then finds that event as a duplicate rather than ok.
	committedByChild := e.count(t, `SELECT count(*) FROM `+e.table("millrace_inbox"))
	c := startConsumer(t, k, e, middleware.Config{}, handlerSpec{name: "billing", topic: topic, group: group,
		handle: func(msg *message.Message) error { return e.write(msg.Context(), group, msg) }})
	testkit.Eventually(t, 2*time.Minute, "every event committed once, by the child or the clean consumer", func() bool {
		return e.count(t, `SELECT count(*) FROM `+e.table("millrace_inbox")) == events &&
			(mode != afterCommit || c.messages(t, "billing", middleware.OutcomeDuplicate) >= 1)
	})
	require.GreaterOrEqual(t, c.messages(t, "billing", middleware.OutcomeOK)+c.messages(t, "billing", middleware.OutcomeDuplicate),
		float64(events-committedByChild), "the clean consumer processed every event the child had not committed")
	require.Equal(t, events, e.count(t, `SELECT count(*) FROM `+e.table("business")), "no event has two effects")
	require.Equal(t, events, e.count(t, `SELECT count(*) FROM `+e.table("millrace_inbox")))
	require.Equal(t, 1, victimRows())
	require.Zero(t, e.count(t, `SELECT count(*) FROM `+e.table("millrace_poison")))
	if mode == afterCommit {
		require.GreaterOrEqual(t, c.messages(t, "billing", middleware.OutcomeDuplicate), 1.0,
			"the committed but unacked victim came back and was recognised as a duplicate")
	}
}

// crashChild is the consumer the parent kills.
func crashChild(t *testing.T) {
	mode, victim := os.Getenv("MILLRACE_CRASH_MODE"), os.Getenv("MILLRACE_CRASH_VICTIM")
	group, topic := os.Getenv("MILLRACE_CRASH_GROUP"), os.Getenv("MILLRACE_CRASH_TOPIC")
	e := &env{db: testdb.Open(t), schema: os.Getenv("MILLRACE_CRASH_SCHEMA")}
	k := newKit(t, os.Getenv("MILLRACE_CRASH_BROKER"), kitOptions{ackWait: 2 * time.Second})
	crash := func() {
		child.Ready()
		select {} // wait for SIGKILL
	}
	spec := handlerSpec{name: "billing", topic: topic, group: group, handle: func(msg *message.Message) error {
		if err := e.write(msg.Context(), group, msg); err != nil {
			return err
		}
		if mode == beforeCommit && msg.Metadata.Get(bus.EventIDKey) == victim {
			crash()
		}
		return nil
	}}
	if mode == afterCommit {
		// Outside the chain: the chain has committed and returned; the
		// router has not acked yet.
		spec.outer = func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil && msg.Metadata.Get(bus.EventIDKey) == victim {
					crash()
				}
				return out, err
			}
		}
	}
	startConsumer(t, k, e, middleware.Config{}, spec)
	select {}
}
