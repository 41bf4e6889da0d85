package bus_test

import (
	"context"
	"database/sql"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// replayWorld is a schema, a topic and its consumer groups on one broker,
// with an effects table the handlers write in their inbox transaction.
type replayWorld struct {
	kind, topic string
	db          *sql.DB
	cfg         bus.Config
	ops         *ops.Client
}

func newReplayWorld(t *testing.T, kind string, groups ...string) *replayWorld {
	t.Helper()
	ctx := context.Background()
	svc := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Relay.PollInterval = 100 * time.Millisecond
	})
	db, cfg := svc.DB, svc.Config
	_, err := db.Exec(`CREATE TABLE "` + cfg.Database.Schema + `".effects (grp text NOT NULL, event_id text NOT NULL)`)
	require.NoError(t, err)
	w := &replayWorld{kind: kind, topic: "replay-_" + testkit.Suffix(), db: db, cfg: cfg}
	brokertest.Cleanup(t, kind, w.topic, groups...)
	w.ops, err = ops.New(ctx, db, cfg)
	require.NoError(t, err)
	return w
}

// run runs a service with cfg and the handlers, each in the consumer group
// of its name, until the test ends or the returned func stops it.
func (w *replayWorld) run(t *testing.T, cfg bus.Config, handlers map[string]bus.HandlerFunc, opts ...bus.Option) (b *bus.Bus, stop func()) {
	t.Helper()
	return w.serve(t, cfg, func(b *bus.Bus) error {
		for _, group := range slices.Sorted(maps.Keys(handlers)) {
			if err := b.Handle(w.topic, group, handlers[group]); err != nil {
				return err
			}
		}
		return nil
	}, opts...)
}

// serve runs a service with cfg and the handlers register registers on
// it, until the test ends or the returned func stops it.
func (w *replayWorld) serve(t *testing.T, cfg bus.Config, register func(*bus.Bus) error, opts ...bus.Option) (b *bus.Bus, stop func()) {
	t.Helper()
	b, err := bus.Open(context.Background(), cfg, w.db, opts...)
	require.NoError(t, err)
	require.NoError(t, register(b))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			require.NoError(t, <-done)
			b.Close()
		})
	}
	t.Cleanup(stop)
	return b, stop
}

// effect records ev's effect for group in the handler's transaction.
func (w *replayWorld) effect(ctx context.Context, group string, ev bus.Event) error {
	_, err := bus.Tx[*sql.Tx](ctx).ExecContext(ctx, `INSERT INTO "`+w.cfg.Database.Schema+`".effects VALUES ($1, $2)`, group, ev.ID)
	return err
}

// effects counts group's effects of eventID.
func (w *replayWorld) effects(t *testing.T, group, eventID string) int {
	t.Helper()
	var n int
	require.NoError(t, w.db.QueryRow(`SELECT count(*) FROM "`+w.cfg.Database.Schema+`".effects WHERE grp = $1 AND event_id = $2`,
		group, eventID).Scan(&n))
	return n
}

// published is the metadata Publish wrote for eventID, read from the outbox.
func (w *replayWorld) published(t *testing.T, eventID string) map[string]string {
	t.Helper()
	rows, err := w.db.Query(`SELECT payload FROM "` + w.cfg.Database.Schema + `".watermill_millrace_outbox ORDER BY "offset"`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var payload []byte
		require.NoError(t, rows.Scan(&payload))
		_, msg, err := envelope.Unwrap(payload)
		require.NoError(t, err)
		if msg.Metadata.Get(bus.EventIDKey) == eventID {
			return msg.Metadata
		}
	}
	require.NoError(t, rows.Err())
	t.Fatalf("no outbox row of event %s", eventID)
	return nil
}

// poisoned waits until one message is poisoned and returns it.
func (w *replayWorld) poisoned(t *testing.T) ops.PoisonedMessage {
	t.Helper()
	var poisoned ops.PoisonedMessage
	testkit.Eventually(t, 2*time.Minute, "a message poisoned", func() bool {
		l, err := w.ops.DLQ().List(context.Background(), ops.Filter{}, 0)
		require.NoError(t, err)
		if len(l.Rows) == 1 {
			poisoned = l.Rows[0]
		}
		return len(l.Rows) == 1
	})
	return poisoned
}

// A message poisoned after its retries carries what the broker and the
// adapter added on its way to the last attempt (on RabbitMQ the retry
// queue's dead-lettering: x-death, x-first-death-*, x-millrace-delivery);
// the poison table keeps it as delivered. Replayed, on every broker, it
// carries only the event's own metadata, so the relay publishes it: it
// takes effect exactly once, and nothing is left in the relay quarantine.
// (adaptertest.DeliveryHeaders checks, on each broker, that every header
// it adds is one its Rules refuse, the rule that leaves them out.)
func TestReplayOfAMessagePoisonedAfterItsRetries(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testReplayAfterRetries)
}

func testReplayAfterRetries(t *testing.T, kind string) {
	ctx := context.Background()
	w := newReplayWorld(t, kind, "billing")
	cfg := w.cfg
	cfg.Broker.Kafka.RetryTopics = true
	cfg.Consumer.Retry.MaxAttempts = 2
	cfg.Consumer.Retry.InitialInterval = 200 * time.Millisecond
	cfg.Consumer.Retry.MaxInterval = 200 * time.Millisecond

	var mu sync.Mutex
	broken := true
	var replayed message.Metadata // the metadata of the replay's delivery
	billing := func(ctx context.Context, ev bus.Event) error {
		mu.Lock()
		defer mu.Unlock()
		if broken {
			return errors.New("billing: the price service timed out")
		}
		replayed = message.Metadata{}
		maps.Copy(replayed, ev.Metadata)
		return w.effect(ctx, "billing", ev)
	}
	b, _ := w.run(t, cfg, map[string]bus.HandlerFunc{"billing": billing})
	id := "ev-_" + testkit.Suffix()
	require.NoError(t, b.PublishInOwnTx(ctx, w.topic, bus.Event{ID: id, Type: "OrderPlaced", AggregateType: "order",
		AggregateID: "o-1", Payload: []byte(`{"total":1}`), Metadata: map[string]string{"tenant": "acme", "x-request-source": "checkout"}}))
	published := w.published(t, id)

	poisoned := w.poisoned(t)
	require.Equal(t, cfg.Consumer.Retry.MaxAttempts, poisoned.Attempts, "poisoned once its retries were used up")
	added := w.added(t, poisoned.ID, published)
	t.Logf("%s added on the way to the last attempt: %v", kind, added)
	if kind == bus.KindRabbitMQ {
		require.Contains(t, added, "x-death", "the retry queue dead-lettered the message back to its queue")
	}

	mu.Lock()
	broken = false
	mu.Unlock()
	dry, err := w.ops.DLQ().Replay(ctx, ops.Selection{IDs: []int64{poisoned.ID}}, ops.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Len(t, dry.Replayed, 1)
	require.Empty(t, dry.Warnings)
	res, err := w.ops.DLQ().Replay(ctx, ops.Selection{IDs: []int64{poisoned.ID}}, ops.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1)

	testkit.Eventually(t, 2*time.Minute, "the replay processed or quarantined", func() bool {
		st, err := w.ops.OutboxStatus(ctx, "")
		require.NoError(t, err)
		return st.Quarantined > 0 || w.effects(t, "billing", id) == 1
	})
	q, err := w.ops.Quarantine().List(ctx, ops.Filter{}, 0)
	require.NoError(t, err)
	require.Empty(t, q.Rows, "the relay quarantined the replay")
	testkit.Eventually(t, time.Minute, "the poison row shows the event processed", func() bool {
		d, err := w.ops.DLQ().Get(ctx, poisoned.ID)
		require.NoError(t, err)
		return d.State == ops.PoisonStateProcessed
	})
	require.Equal(t, 1, w.effects(t, "billing", id), "one effect")

	mu.Lock()
	defer mu.Unlock()
	want := map[string]string{middleware.ReplayOfKey: poisoned.MessageID, middleware.ReplayGroupsKey: "billing"}
	for k, v := range published {
		if !envelopeKeys[k] {
			want[k] = v
		}
	}
	require.Equal(t, want, map[string]string(replayed), "the replay carries the event's own metadata and its replay markers")
}

// added returns the keys of poison row id's metadata that published
// lacks, sorted, and checks that the others are as published.
func (w *replayWorld) added(t *testing.T, id int64, published map[string]string) []string {
	t.Helper()
	d, err := w.ops.DLQ().Get(context.Background(), id)
	require.NoError(t, err)
	var added []string
	for k, v := range d.Metadata {
		if want, ok := published[k]; ok {
			require.Equal(t, want, v, "metadata %s as delivered", k)
			continue
		}
		added = append(added, k)
	}
	slices.Sort(added)
	return added
}

// envelopeKeys are the keys EventFromMessage takes out of Event.Metadata.
var envelopeKeys = map[string]bool{
	bus.EventIDKey: true, bus.EventTypeKey: true, bus.AggregateTypeKey: true, bus.AggregateIDKey: true,
	bus.AggregateVersionKey: true, bus.SchemaVersionKey: true, bus.OccurredAtKey: true, bus.CorrelationIDKey: true,
	bus.CausationIDKey: true, bus.TraceparentKey: true, bus.TracestateKey: true, bus.BaggageKey: true, bus.ContentTypeKey: true,
}

// A replay the configured broker would refuse (here a body over
// broker.rabbitmq.max_message_bytes, lowered since the event was
// published) is skipped with the broker's reason and a warning, in the dry
// run as in the replay itself, and nothing is written. Forced, it is
// replayed with a warning, the relay quarantines it, and the DLQ shows the
// message quarantined with the quarantine's row and reason; once the limit
// is raised again, replaying that row takes effect and the DLQ shows the
// event processed.
func TestAReplayTheBrokerRefuses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newReplayWorld(t, bus.KindRabbitMQ, "billing")
	var broken atomic.Bool
	broken.Store(true)
	handlers := map[string]bus.HandlerFunc{"billing": func(ctx context.Context, ev bus.Event) error {
		if broken.Load() {
			return bus.Permanent(errors.New("billing: no price list"))
		}
		return w.effect(ctx, "billing", ev)
	}}
	b, stop := w.run(t, w.cfg, handlers)
	big := []byte(`{"lines":"` + strings.Repeat("x", 2000) + `"}`)
	id := "ev-_" + testkit.Suffix()
	require.NoError(t, b.PublishInOwnTx(ctx, w.topic, bus.Event{ID: id, Type: "OrderPlaced", AggregateType: "order", AggregateID: "o-1", Payload: big}))
	poisoned := w.poisoned(t)
	stop()

	lowered := w.cfg
	lowered.Broker.RabbitMQ.MaxMessageBytes = 1024
	_, stop = w.run(t, lowered, handlers)
	oc, err := ops.New(ctx, w.db, lowered)
	require.NoError(t, err)
	for _, dryRun := range []bool{true, false} {
		res, err := oc.DLQ().Replay(ctx, ops.Selection{All: true}, ops.ReplayOptions{DryRun: dryRun})
		require.NoError(t, err)
		require.Empty(t, res.Replayed, "dry run %v", dryRun)
		require.Zero(t, res.Messages)
		require.Len(t, res.Skipped, 1)
		require.Equal(t, ops.SkipRefusedByBroker, res.Skipped[0].Reason)
		require.Contains(t, res.Skipped[0].Detail, "max_message_bytes")
		require.Nil(t, res.Skipped[0].ProcessedAt)
		require.Len(t, res.Warnings, 1)
		require.Contains(t, res.Warnings[0], "the relay would quarantine its replay")
	}
	forced, err := oc.DLQ().Replay(ctx, ops.Selection{All: true}, ops.ReplayOptions{Force: true})
	require.NoError(t, err)
	require.Len(t, forced.Replayed, 1)
	require.Contains(t, forced.Warnings[0], "the relay will quarantine it")
	var shown ops.PoisonedDetail
	testkit.Eventually(t, time.Minute, "the DLQ shows the replay quarantined", func() bool {
		shown, err = oc.DLQ().Get(ctx, poisoned.ID)
		require.NoError(t, err)
		return shown.State == ops.PoisonStateQuarantined
	})
	q, err := oc.Quarantine().List(ctx, ops.Filter{}, 0)
	require.NoError(t, err)
	require.Len(t, q.Rows, 1)
	require.Equal(t, &ops.ReplayQuarantine{ID: q.Rows[0].ID, Reason: q.Rows[0].Reason, QuarantinedAt: q.Rows[0].QuarantinedAt}, shown.ReplayQuarantine)
	require.Contains(t, shown.ReplayQuarantine.Reason, "max_message_bytes")
	stop()

	broken.Store(false)
	w.run(t, w.cfg, handlers)
	res, err := w.ops.Quarantine().Replay(ctx, ops.Selection{IDs: []int64{q.Rows[0].ID}}, ops.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1)
	testkit.Eventually(t, time.Minute, "the DLQ shows the event processed", func() bool {
		shown, err = w.ops.DLQ().Get(ctx, poisoned.ID)
		require.NoError(t, err)
		return shown.State == ops.PoisonStateProcessed
	})
	require.Equal(t, 1, w.effects(t, "billing", id))
	require.Nil(t, shown.ReplayQuarantine)
}

// A DLQ replay written before replays kept to the event's own metadata
// and named their groups carries the broker headers of the delivery it came
// from; the relay quarantines it on RabbitMQ ("header name x-death:
// reserved"). Replayed from the quarantine, it is written with the event's
// own metadata, its replay marker and, from the replay history, the group
// it is for: it takes effect there, and the topic's other group acks it
// unprocessed.
func TestQuarantineReplayOfAnOlderDLQReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newReplayWorld(t, bus.KindRabbitMQ, "billing", "audit")
	var mu sync.Mutex
	var seen map[string]string
	reg := prometheus.NewRegistry()
	w.run(t, w.cfg, map[string]bus.HandlerFunc{
		"billing": func(ctx context.Context, ev bus.Event) error {
			mu.Lock()
			seen = ev.Metadata
			mu.Unlock()
			return w.effect(ctx, "billing", ev)
		},
		"audit": func(ctx context.Context, ev bus.Event) error { return w.effect(ctx, "audit", ev) },
	}, bus.WithRegistry(reg))
	id := "ev-_" + testkit.Suffix()
	old := message.NewMessage("replay-"+id[3:], []byte(`{"total":1}`))
	for k, v := range map[string]string{
		bus.EventIDKey: id, bus.EventTypeKey: "OrderPlaced", bus.AggregateTypeKey: "order", bus.AggregateIDKey: "o-1",
		bus.ContentTypeKey: "application/json", "tenant": "acme", middleware.ReplayOfKey: "original-message",
		"x-death": `[{"count":1,"queue":"billing.retry"}]`, "x-first-death-queue": "billing.retry",
		"x-first-death-reason": "expired", "x-millrace-delivery": "3",
	} {
		old.Metadata.Set(k, v)
	}
	w.poisonedAndReplayedAs(t, "billing", id, "original-message", old.UUID)
	brokertest.WriteOutboxWithWatermill(t, w.db, w.cfg, w.topic, old)
	testkit.Eventually(t, time.Minute, "the old replay quarantined", func() bool {
		st, err := w.ops.OutboxStatus(ctx, "")
		require.NoError(t, err)
		return st.Quarantined == 1
	})

	res, err := w.ops.Quarantine().Replay(ctx, ops.Selection{All: true}, ops.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1)
	require.Empty(t, res.Skipped)
	testkit.Eventually(t, time.Minute, "billing processed the replay, audit acked it", func() bool {
		return w.effects(t, "billing", id) == 1 && outcomes(t, reg, "audit", middleware.OutcomeNotTargeted) == 1
	})
	require.Zero(t, w.effects(t, "audit", id))
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, map[string]string{"tenant": "acme", middleware.ReplayOfKey: "original-message", middleware.ReplayGroupsKey: "billing"}, seen)
	replayed := false
	l, err := w.ops.Quarantine().List(ctx, ops.Filter{Replayed: &replayed}, 0)
	require.NoError(t, err)
	require.Empty(t, l.Rows, "the quarantined row is marked replayed")
}

// poisonedAndReplayedAs records, as the consumer chain and a DLQ replay do,
// that group poisoned message messageID of event eventID and that it was
// replayed as message replayID.
func (w *replayWorld) poisonedAndReplayedAs(t *testing.T, group, eventID, messageID, replayID string) {
	t.Helper()
	ctx := context.Background()
	tables := store.Tables{Schema: w.cfg.Database.Schema, OutboxTopic: w.cfg.Outbox.Topic}
	now := time.Now()
	require.NoError(t, tables.StorePoisoned(ctx, w.db, store.Poisoned{ConsumerGroup: group, Handler: group, SourceTopic: w.topic,
		MessageID: messageID, EventID: eventID, EventType: "OrderPlaced", Payload: []byte(`{"total":1}`), Metadata: map[string]string{},
		Reason: "boom", ErrorClass: middleware.ClassTransient, Attempts: 3, FirstFailureAt: now, LastFailureAt: now, PoisonedAt: now}))
	l, err := w.ops.DLQ().List(ctx, ops.Filter{Group: group}, 0)
	require.NoError(t, err)
	require.Len(t, l.Rows, 1)
	require.NoError(t, tables.MarkPoisonReplayed(ctx, w.db, []int64{l.Rows[0].ID}, []string{replayID}, "an earlier version"))
}

// A replay reaches only the consumer group it was poisoned in, on every
// broker. billing poisons an event that audit processes; audit's inbox row
// of it is then pruned (as consumer.inbox.retention does), and analytics,
// a group created after the event, subscribes (on NATS and Kafka with
// consumer.start: all, so it processes the event too; its row is pruned as
// well). The replay of billing's row, for billing as the dry run
// says, takes effect in billing only: audit and analytics ack it without
// calling their handlers and write no inbox row, counted as not_targeted.
func TestReplayReachesOnlyTheGroupItWasPoisonedIn(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testReplayReachesOnlyItsGroup)
}

func testReplayReachesOnlyItsGroup(t *testing.T, kind string) {
	ctx := context.Background()
	w := newReplayWorld(t, kind, "billing", "audit", "analytics")
	var broken atomic.Bool
	broken.Store(true)
	effect := func(group string) bus.HandlerFunc {
		return func(ctx context.Context, ev bus.Event) error {
			if group == "billing" && broken.Load() {
				return bus.Permanent(errors.New("billing: no price list"))
			}
			return w.effect(ctx, group, ev)
		}
	}
	b, stop := w.run(t, w.cfg, map[string]bus.HandlerFunc{"billing": effect("billing"), "audit": effect("audit")})
	id := "ev-_" + testkit.Suffix()
	require.NoError(t, b.PublishInOwnTx(ctx, w.topic, bus.Event{ID: id, Type: "OrderPlaced", AggregateType: "order", AggregateID: "o-1", Payload: []byte(`{}`)}))
	poisoned := w.poisoned(t)
	testkit.Eventually(t, time.Minute, "audit processed the event", func() bool { return w.effects(t, "audit", id) == 1 })
	stop()

	reg := prometheus.NewRegistry()
	cfg := w.cfg
	fromTheStart := kind != bus.KindRabbitMQ // a RabbitMQ queue gets only what is published after it exists
	if fromTheStart {
		cfg.Consumer.Handlers = map[string]middleware.Config{"analytics": {Start: adapters.StartAll}}
	}
	w.run(t, cfg, map[string]bus.HandlerFunc{"billing": effect("billing"), "audit": effect("audit"), "analytics": effect("analytics")},
		bus.WithRegistry(reg))
	if fromTheStart {
		testkit.Eventually(t, time.Minute, "analytics processed the event", func() bool { return w.effects(t, "analytics", id) == 1 })
	}
	inbox := `"` + w.cfg.Database.Schema + `".millrace_inbox`
	_, err := w.db.Exec(`DELETE FROM `+inbox+` WHERE consumer_group IN ('audit', 'analytics') AND event_id = $1`, id)
	require.NoError(t, err)

	broken.Store(false)
	sel := ops.Selection{IDs: []int64{poisoned.ID}}
	dry, err := w.ops.DLQ().Replay(ctx, sel, ops.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Len(t, dry.Replayed, 1)
	require.Equal(t, []string{"billing"}, dry.Replayed[0].TargetGroups)
	_, err = w.ops.DLQ().Replay(ctx, sel, ops.ReplayOptions{})
	require.NoError(t, err)
	first := map[string]int{"audit": 1, "analytics": map[bool]int{true: 1, false: 0}[fromTheStart]}
	settled := func(group string) bool { // acked, or processed again
		return outcomes(t, reg, group, middleware.OutcomeNotTargeted) == 1 || w.effects(t, group, id) > first[group]
	}
	testkit.Eventually(t, time.Minute, "billing processed the replay, audit and analytics had it", func() bool {
		return w.effects(t, "billing", id) == 1 && settled("audit") && settled("analytics")
	})
	for group, n := range first {
		require.Equal(t, n, w.effects(t, group, id), "%s: the first delivery's effect only", group)
		require.EqualValues(t, 1, outcomes(t, reg, group, middleware.OutcomeNotTargeted), group)
	}
	var rows int
	require.NoError(t, w.db.QueryRow(`SELECT count(*) FROM `+inbox+` WHERE consumer_group IN ('audit', 'analytics') AND event_id = $1`, id).Scan(&rows))
	require.Zero(t, rows, "no inbox row written for the replay in other groups")
	testkit.Eventually(t, time.Minute, "the poison row shows the event processed", func() bool {
		d, err := w.ops.DLQ().Get(ctx, poisoned.ID)
		require.NoError(t, err)
		return d.State == ops.PoisonStateProcessed
	})
}

// outcomes reads millrace_consumer_messages_total of handler and outcome
// from reg.
func outcomes(t *testing.T, reg *prometheus.Registry, handler, outcome string) float64 {
	t.Helper()
	return testkit.Metric(t, reg, middleware.MetricMessages, map[string]string{"handler": handler, "outcome": outcome})
}
