package bus_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

// A new consumer group on a topic with history starts where consumer.start
// says, with the same meaning on every broker: by default (new) it gets
// the events published from the moment it is first provisioned, none from
// before, also when its first consumer joins later; with all (NATS, Kafka)
// every event the topic holds. A group that exists keeps its position
// whatever consumer.start says later. RabbitMQ refuses all at the adapter.
func TestNewGroupStartsWhereConsumerStartSays(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testStart)
}

// startRecorder records the events each handler was called with.
type startRecorder struct {
	mu  sync.Mutex
	got map[string][]string // handler -> event ids, in order
}

func (r *startRecorder) handler(name string) bus.HandlerFunc {
	return func(_ context.Context, ev bus.Event) error {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.got[name] = append(r.got[name], ev.ID)
		return nil
	}
}

func (r *startRecorder) of(name string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got[name])
}

// startRig is one topic of a real broker with the consumer groups of the
// start test: existing (the topic's other consumer), fresh (unordered, as
// handlers are by default), early (provisioned before its first consumer)
// and, where the broker keeps history, history (start: all).
type startRig struct {
	t                               *testing.T
	cfg                             bus.Config
	db                              *sql.DB
	broker                          adapters.Broker
	topic                           string
	existing, fresh, early, history string
	hasHistory                      bool
	rec                             *startRecorder
}

func newStartRig(t *testing.T, kind string) *startRig {
	ctx := context.Background()
	svc := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Relay.Enabled = new(bool)
		// Ordered, and one aggregate (so one partition on Kafka): every
		// group gets the events in publishing order, and once it got a
		// later one it would have got any earlier one it was going to.
		cfg.Consumer.Ordered = new(true)
	})
	r := &startRig{t: t, db: svc.DB, cfg: svc.Config, hasHistory: kind != bus.KindRabbitMQ, rec: &startRecorder{got: map[string][]string{}}}
	suffix := testdb.UniqueName("")[2:]
	r.topic = "orders-" + suffix
	r.existing, r.fresh, r.early, r.history = "existing-"+suffix, "fresh-"+suffix, "early-"+suffix, "history-"+suffix
	brokertest.Cleanup(t, kind, r.topic, r.existing, r.fresh, r.early, r.history)
	r.cfg.Consumer.Handlers = map[string]middleware.Config{r.fresh: {Ordered: new(false)}}
	if r.hasHistory {
		r.cfg.Consumer.Handlers[r.history] = middleware.Config{Start: adapters.StartAll}
	}
	var err error
	r.broker, err = bus.OpenBroker(ctx, r.cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.broker.Close() })
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("handled: %v", r.rec.got)
		}
	})
	return r
}

func (r *startRig) publish(ids ...string) {
	r.t.Helper()
	for _, id := range ids {
		require.NoError(r.t, r.broker.Publisher().Publish(r.topic, delivered(context.Background(), id, orderCreated("o-1"))))
	}
}

// run runs the handlers of fresh, early and history until until holds.
func (r *startRig) run(until func() bool) {
	r.t.Helper()
	b, err := bus.Open(context.Background(), r.cfg, r.db)
	require.NoError(r.t, err)
	defer b.Close()
	handlers := []string{r.fresh, r.early}
	if r.hasHistory {
		handlers = append(handlers, r.history)
	}
	for _, h := range handlers {
		require.NoError(r.t, b.Handle(r.topic, h, r.rec.handler(h)))
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	testkit.Eventually(r.t, 2*time.Minute, "the groups got their events", until)
	stop()
	require.NoError(r.t, <-done)
}

func testStart(t *testing.T, kind string) {
	ctx := context.Background()
	r := newStartRig(t, kind)
	// The topic's history: another group's, published before the others exist.
	require.NoError(t, r.broker.Provision(ctx, r.topic, r.existing))
	old := []string{"old-0", "old-1", "old-2"}
	r.publish(old...)
	// A group provisioned before its first consumer joins starts there.
	require.NoError(t, r.broker.ProvisionGroup(ctx, r.topic, adapters.GroupSpec{Name: r.early, Start: adapters.StartNew}))
	err := r.broker.ProvisionGroup(ctx, r.topic, adapters.GroupSpec{Name: "refused-" + r.early, Start: adapters.StartAll})
	if r.hasHistory {
		require.NoError(t, err)
	} else {
		require.True(t, adapters.IsPermanent(err), "%v", err)
		require.ErrorContains(t, err, "cannot start at the topic's history")
	}
	mid := []string{"mid-0", "mid-1"}
	r.publish(mid...)

	// Run provisions every handler's group before its consumers start: once
	// early has its events, fresh exists too.
	fresh, early, history := r.fresh, r.early, r.history
	fresh1 := []string{"new-0", "new-1", "new-2"}
	r.run(func() bool {
		if len(r.rec.of(early)) < len(mid) {
			return false
		}
		if len(r.rec.of(fresh)) == 0 && len(r.rec.of(early)) == len(mid) {
			r.publish(fresh1...)
		}
		return len(r.rec.of(fresh)) == len(fresh1) && len(r.rec.of(early)) == len(mid)+len(fresh1) &&
			(!r.hasHistory || len(r.rec.of(history)) == len(old)+len(mid)+len(fresh1))
	})
	require.ElementsMatch(t, fresh1, r.rec.of(fresh), "new: only what was published once the group existed")
	require.Equal(t, append(slices.Clone(mid), fresh1...), r.rec.of(early), "new: from when it was provisioned, not from its first consumer")
	if r.hasHistory {
		require.Equal(t, append(append(slices.Clone(old), mid...), fresh1...), r.rec.of(history), "all: the topic's history first")
	}

	// The groups exist now: starting them at all changes nothing.
	if r.hasHistory {
		r.cfg.Consumer.Handlers[fresh] = middleware.Config{Ordered: new(false), Start: adapters.StartAll}
		r.cfg.Consumer.Handlers[early] = middleware.Config{Start: adapters.StartAll}
	}
	later := []string{"later-0"}
	r.publish(later...)
	r.run(func() bool {
		return len(r.rec.of(fresh)) == len(fresh1)+len(later) && len(r.rec.of(early)) == len(mid)+len(fresh1)+len(later)
	})
	require.ElementsMatch(t, append(slices.Clone(fresh1), later...), r.rec.of(fresh), "an existing group keeps its position")
	require.Equal(t, append(append(slices.Clone(mid), fresh1...), later...), r.rec.of(early), "an existing group keeps its position")
}

// consumer.start is "new" or "all", and RabbitMQ refuses "all", naming the
// key and the reason, for the section and for each handler override.
func TestConsumerStartIsChecked(t *testing.T) {
	t.Parallel()
	check := func(kind string, consumer middleware.Config) error {
		var cfg bus.Config
		cfg.Broker.Kind = kind
		cfg.Broker.RabbitMQ.URL = "amqp://guest:guest@127.0.0.1:5672/"
		cfg.Broker.Kafka.Brokers = []string{"127.0.0.1:9092"}
		cfg.Consumer = consumer
		return cfg.WithDefaults().Validate()
	}
	require.Equal(t, adapters.StartNew, bus.Config{}.WithDefaults().Consumer.Start, "the default")
	err := check(bus.KindNATS, middleware.Config{Start: "latest"})
	require.ErrorContains(t, err, `consumer.start: must be one of new, all; got "latest"`)
	for _, kind := range []string{bus.KindNATS, bus.KindKafka} {
		require.NoError(t, check(kind, middleware.Config{Start: adapters.StartAll,
			Handlers: map[string]middleware.Config{"projection": {Start: adapters.StartNew}}}), kind)
	}
	err = check(bus.KindRabbitMQ, middleware.Config{Start: adapters.StartAll,
		Handlers: map[string]middleware.Config{"projection": {Start: adapters.StartAll}, "billing": {Workers: 2}}})
	var ce *bus.ConfigError
	require.ErrorAs(t, err, &ce)
	var paths []string
	for _, p := range ce.Problems {
		var fe *bus.FieldError
		require.ErrorAs(t, p, &fe)
		paths = append(paths, fe.Path)
		require.Contains(t, fe.Error(), "must be new with broker.kind rabbitmq: a RabbitMQ queue gets only what is published after it is bound")
	}
	require.Equal(t, []string{"consumer.handlers.projection.start", "consumer.start"}, paths, fmt.Sprint(err))
	require.NoError(t, check(bus.KindRabbitMQ, middleware.Config{}))
}
