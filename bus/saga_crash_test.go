package bus_test

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testkit/child"
	"github.com/millrace-io/millrace/internal/testing/testlog"
	"github.com/millrace-io/millrace/ops"
)

const (
	sagaChildRole   = "saga-consumer"
	sagaChildSchema = "MILLRACE_SAGA_SCHEMA"
	sagaChildSuffix = "MILLRACE_SAGA_SUFFIX"
	sagaChildKill   = "MILLRACE_SAGA_KILL" // an event type: SIGKILL once its step committed, before the ack
	sagaDelivered   = "SAGA_DELIVERED"     // a stdout line per delivery the chain finished: event type and id
)

// sagaCrashConfig is the parent's and the child's config: NATS with a short
// ack wait, so that an unacked delivery of a killed consumer comes back soon.
func sagaCrashConfig(schema string) bus.Config {
	var cfg bus.Config
	cfg.Database.URL = testdb.URL()
	cfg.Database.Schema = schema
	cfg.Broker.Kind = bus.KindNATS
	cfg.Broker.NATS.URL = brokertest.NATSURL()
	cfg.Broker.NATS.Consumer.AckWait = 2 * time.Second
	cfg.Relay.PollInterval = 50 * time.Millisecond
	return cfg
}

// runSagaConsumerChild is the consumer the crash test runs and kills
// (TestMain dispatches to it); it returns the process's exit code.
func runSagaConsumerChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	cfg := sagaCrashConfig(os.Getenv(sagaChildSchema)).WithDefaults()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "saga consumer child:", err)
		return 1
	}
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		return fail(err)
	}
	defer db.Close()
	kill := os.Getenv(sagaChildKill)
	// Outside the chain: the step's transaction has committed, the message
	// is not acked yet.
	report := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				typ := msg.Metadata.Get(bus.EventTypeKey)
				fmt.Println(sagaDelivered, typ, msg.Metadata.Get(bus.EventIDKey))
				if typ == kill {
					_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
					select {}
				}
			}
			return out, err
		}
	}
	b, err := bus.Open(ctx, cfg, db, bus.WithRouterMiddleware(report))
	if err != nil {
		return fail(err)
	}
	defer b.Close()
	suffix := os.Getenv(sagaChildSuffix)
	if err := orderSagaOn(b, newSagaTopics(suffix), time.Hour).Handle(b, "saga"+suffix); err != nil {
		return fail(err)
	}
	if err := b.Run(ctx); err != nil && ctx.Err() == nil {
		return fail(err)
	}
	return 0
}

// A saga consumer killed with SIGKILL after a step's commit and before its
// ack: the redelivered event finds the step applied (the inbox mark
// committed with it) and does not apply it again; the saga then completes.
func TestSagaStepNotAppliedTwiceAfterConsumerKill(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Open(t)
	schema := testdb.Schema(t, db)
	cfg := sagaCrashConfig(schema)
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	b, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	defer b.Close()
	oc, err := ops.New(ctx, db, cfg)
	require.NoError(t, err)
	suffix := "-" + testkit.Suffix()
	tp := newSagaTopics(suffix)
	for _, topic := range []string{tp.orders.Name(), tp.payments.Name(), tp.reserved.Name(), tp.timeouts.Name()} {
		brokertest.Cleanup(t, bus.KindNATS, topic, "saga"+suffix+"."+topic)
	}
	start := func(kill string, out *testlog.Buffer) *child.Process {
		return child.Start(t, child.Options{Role: sagaChildRole, Stdout: out,
			Env: []string{sagaChildSchema + "=" + schema, sagaChildSuffix + "=" + suffix, sagaChildKill + "=" + kill}})
	}
	commands := func() map[string]int {
		tb := testBundle{db: db, schema: schema, cfg: b.Config()}
		out := map[string]int{}
		for _, r := range tb.outbox(t) {
			if r.topic == tp.commands {
				out[r.event.Type]++
			}
		}
		return out
	}
	instance := func() (ops.SagaInstance, bool) {
		inst, err := oc.Saga(ctx, "order_fulfilment", "o-1")
		return inst, err == nil
	}

	first := &testlog.Buffer{} // the child's stdout, read while it writes
	victim := start("PaymentCharged", first)
	require.NoError(t, b.PublishInOwnTx(ctx, tp.orders.Name(), mustEvent(t, tp.orders, sagaOrderPlaced{orderRef{"o-1"}})))
	testkit.Eventually(t, time.Minute, "the saga started", func() bool { _, ok := instance(); return ok })
	charged, err := tp.payments.Event(sagaCharged{orderRef{"o-1"}})
	require.NoError(t, err)
	charged.ID = "charged-o-1"
	require.NoError(t, b.PublishInOwnTx(ctx, tp.payments.Name(), charged))
	select {
	case <-victim.Done():
	case <-time.After(time.Minute):
		t.Fatal("the consumer was not killed after the PaymentCharged step")
	}
	require.True(t, victim.KilledBySIGKILL(), "%v", victim.Err())
	inst, _ := instance()
	require.Equal(t, int64(2), inst.Version, "the step committed before the kill")
	require.Equal(t, map[string]int{"ChargePayment": 1, "ReserveStock": 1}, commands())

	second := &testlog.Buffer{}
	start("", second)
	testkit.Eventually(t, time.Minute, "the unacked PaymentCharged delivered again", func() bool {
		return strings.Count(second.String(), sagaDelivered+" PaymentCharged charged-o-1\n") == 1
	})
	inst, _ = instance()
	require.Equal(t, int64(2), inst.Version, "the redelivered step was not applied again")
	require.Equal(t, map[string]int{"ChargePayment": 1, "ReserveStock": 1}, commands())

	require.NoError(t, b.PublishInOwnTx(ctx, tp.reserved.Name(), mustEvent(t, tp.reserved, sagaStockReserved{orderRef{"o-1"}})))
	testkit.Eventually(t, time.Minute, "the saga completed", func() bool { inst, ok := instance(); return ok && inst.CompletedAt != nil })
	require.Equal(t, map[string]int{"ChargePayment": 1, "ReserveStock": 1, "NotifyCustomer": 1}, commands())
}
