package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

// parkCase is one run of the parked-aggregate scenario: four aggregates of
// five events each; a1's second event fails until it is "fixed" and is
// replayed, a2's third fails for good and is skipped.
type parkCase struct {
	k      *kit
	e      *env
	topic  string
	group  string
	fixed  atomic.Bool
	tables store.Tables
}

// fails is the scenario's handler verdict for msg.
func (p *parkCase) fails(msg *message.Message) error {
	id := msg.Metadata.Get(bus.EventIDKey)
	switch {
	case strings.HasSuffix(id, "-a1-2") && !p.fixed.Load():
		return bus.Permanent(errors.New("a1 v2 cannot be handled yet"))
	case strings.HasSuffix(id, "-a2-3"):
		return bus.Permanent(errors.New("a2 v3 can never be handled"))
	}
	return nil
}

func (p *parkCase) events(t *testing.T, from, to int) []*message.Message {
	var msgs []*message.Message
	for v := from; v <= to; v++ {
		for a := range 4 {
			msgs = append(msgs, event(fmt.Sprintf("%s-a%d-%d", p.topic, a, v), fmt.Sprintf("a%d", a), int64(v), "{}"))
		}
	}
	return msgs
}

// waitFor waits until the number of business rows is want.
func (p *parkCase) waitFor(t *testing.T, want int) {
	t.Helper()
	require.Eventually(t, func() bool {
		return p.e.rows(t, "business", "") == want
	}, 60*time.Second, 20*time.Millisecond, "business rows")
}

// poisonID is the poison row of the event ending in suffix.
func (p *parkCase) poisonID(t *testing.T, suffix string) int64 {
	var id int64
	require.NoError(t, p.e.db.QueryRow(`SELECT id FROM `+p.e.table("millrace_poison")+` WHERE event_id LIKE '%'||$1`, suffix).Scan(&id))
	return id
}

// versions are the versions of aggregate a in the order they took effect.
func (p *parkCase) versions(t *testing.T, a string) string {
	var s string
	require.NoError(t, p.e.db.QueryRow(`SELECT coalesce(string_agg(version::text, ',' ORDER BY seq), '') FROM `+
		p.e.table("business")+` WHERE aggregate_id = $1`, a).Scan(&s))
	return s
}

func TestParkHoldsAnAggregateUntilReplayOrSkip(t *testing.T) {
	t.Parallel()
	testkit.Each(t, kitNames[1:], func(t *testing.T, name string) {
		runParkCase(t, newKit(t, name, kitOptions{}), false)
	})
	t.Run("kafka_batch", func(t *testing.T) {
		t.Parallel()
		runParkCase(t, newKit(t, bus.KindKafka, kitOptions{}), true)
	})
}

func runParkCase(t *testing.T, k *kit, batch bool) {
	e := newEnv(t)
	p := &parkCase{k: k, e: e, topic: uniqueName(t, "t"), group: uniqueName(t, "g"), tables: store.Tables{Schema: e.schema}}
	k.provision(t, p.topic, p.group)
	cfg := middleware.Config{Ordered: ptr(true), Workers: 4}
	fastRetry(&cfg, 2)
	spec := handlerSpec{name: "h", topic: p.topic, group: p.group, handle: func(msg *message.Message) error {
		if err := p.fails(msg); err != nil {
			return err
		}
		return e.write(msg.Context(), p.group, msg)
	}}
	if batch {
		cfg.Batch.MaxMessages = 8
		spec.handle, spec.batch = nil, func(ctx context.Context, msgs []*message.Message) error {
			failures := middleware.BatchFailures{}
			for _, msg := range msgs {
				if err := p.fails(msg); err != nil {
					failures[middleware.EventID(msg)] = err
				} else if err := e.write(ctx, p.group, msg); err != nil {
					return err
				}
			}
			if len(failures) > 0 {
				return failures
			}
			return nil
		}
	}
	c := startConsumer(t, k, e, cfg, spec)
	publish(t, k.pub, p.topic, p.events(t, 1, 5)...)
	// a1 v2 and a2 v3 poisoned; a1 v3-v5 and a2 v4-v5 parked.
	p.waitFor(t, 20-4-3)
	require.Eventually(t, func() bool { return c.messages(t, "h", middleware.OutcomeParked) == 5 }, 30*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool {
		return c.metric(t, middleware.MetricParkedAggregates, map[string]string{"handler": "h"}) == 2
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, "1", p.versions(t, "a1"))
	require.Equal(t, "1,2", p.versions(t, "a2"))

	// A live event of a parked aggregate is parked too, behind the others.
	publish(t, k.pub, p.topic, p.events(t, 6, 6)...)
	p.waitFor(t, 13+2)
	require.Eventually(t, func() bool { return c.messages(t, "h", middleware.OutcomeParked) == 7 }, 30*time.Second, 20*time.Millisecond)

	p.fixed.Store(true)
	ctx := context.Background()
	require.NoError(t, p.tables.ReleaseParks(ctx, e.db, []int64{p.poisonID(t, "-a1-2")}, false))
	require.NoError(t, p.tables.ReleaseParks(ctx, e.db, []int64{p.poisonID(t, "-a2-3")}, true))
	p.waitFor(t, 24-1)
	require.Equal(t, "1,2,3,4,5,6", p.versions(t, "a1"))
	require.Equal(t, "1,2,4,5,6", p.versions(t, "a2"))
	require.Equal(t, "1,2,3,4,5,6", p.versions(t, "a0"))
	require.Eventually(t, func() bool {
		return e.rows(t, "millrace_parks", "") == 0 &&
			e.rows(t, "millrace_parked", "") == 0
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, 1, e.rows(t, "millrace_poison", `skipped_at IS NOT NULL`))
}

func TestParkKeepsParkedMessagesByteForByte(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tables := store.Tables{Schema: e.schema}
	ctx := context.Background()
	k := store.ParkKey{Group: "g", Handler: "h", Key: "a\x00b"}
	meta := map[string]string{"k\x00": "v\xff\x00", "aggregate-id": "a\x00b", "": ""}
	tx, err := e.db.Begin()
	require.NoError(t, err)
	require.NoError(t, tables.StorePoisonedParked(ctx, tx, store.Poisoned{ConsumerGroup: "g", Handler: "h", SourceTopic: "t",
		MessageID: "m0", Metadata: map[string]string{}, ErrorClass: middleware.ClassPermanent, Attempts: 1,
		FirstFailureAt: time.Now(), LastFailureAt: time.Now(), PoisonedAt: time.Now()}, k,
		store.ParkedMessage{MessageID: "m0", Payload: []byte{0, 0xff}, Metadata: meta}))
	require.NoError(t, tx.Commit())
	did, err := tables.AppendParked(ctx, e.db, k, store.ParkedMessage{MessageID: "m1", Payload: nil, Metadata: meta})
	require.NoError(t, err)
	require.Equal(t, store.Parked, did)
	did, err = tables.AppendParked(ctx, e.db, store.ParkKey{Group: "g", Handler: "h", Key: "other"}, store.ParkedMessage{MessageID: "m2"})
	require.NoError(t, err)
	require.Equal(t, store.NotParked, did)

	var poisonID int64
	require.NoError(t, e.db.QueryRow(`SELECT id FROM `+e.table("millrace_poison")).Scan(&poisonID))
	require.NoError(t, tables.ReleaseParks(ctx, e.db, []int64{poisonID}, false))
	claimed, err := tables.ClaimParks(ctx, e.db, "g", "h", "me", time.Minute, 8)
	require.NoError(t, err)
	require.Equal(t, []string{"a\uFFFDb"}, claimed, "an order key is stored as text")
	again, err := tables.ClaimParks(ctx, e.db, "g", "h", "other", time.Minute, 8)
	require.NoError(t, err)
	require.Empty(t, again, "a live lease keeps a competing consumer out")
	for i, want := range []string{"m0", "m1"} {
		m, owned, err := tables.NextParked(ctx, e.db, k, "me", time.Minute)
		require.NoError(t, err)
		require.True(t, owned)
		require.Equal(t, want, m.MessageID)
		require.Equal(t, [][]byte{{0, 0xff}, {}}[i], m.Payload)
		require.Equal(t, meta, m.Metadata)
		require.NoError(t, tables.DoneParked(ctx, e.db, m.ID))
	}
	done, err := tables.FinishPark(ctx, e.db, k, "me")
	require.NoError(t, err)
	require.True(t, done)
}

func ptr[T any](v T) *T { return &v }

func TestParkConfig(t *testing.T) {
	t.Parallel()
	ordered := middleware.Config{Ordered: ptr(true)}.WithDefaults()
	require.True(t, ordered.Parks(), "an ordered handler parks by default")
	ordered.Poison.Park = ptr(false)
	require.False(t, ordered.Parks(), "poison.park false keeps today's behaviour")
	require.False(t, middleware.Config{}.WithDefaults().Parks(), "an unordered handler never parks")

	_, err := middleware.New(middleware.Config{Ordered: ptr(true), Poison: middleware.PoisonConfig{
		Destination: middleware.PoisonToTopic, Topic: "poison", Park: ptr(true)}}, middleware.Deps{})
	require.ErrorContains(t, err, "consumer.poison.park")
	_, err = middleware.New(middleware.Config{Handlers: map[string]middleware.Config{"h": {Ordered: ptr(true), Poison: middleware.PoisonConfig{
		Destination: middleware.PoisonToTopic, Topic: "poison", Park: ptr(true)}}}}, middleware.Deps{})
	require.ErrorContains(t, err, "consumer.handlers.h.poison.park")
}

// Two consumers of one group compete for a released park: the lease lets
// one drain it at a time, so its messages take effect once each, in order.
func TestParkDrainsOnceWithCompetingConsumers(t *testing.T) {
	t.Parallel()
	k := newKit(t, bus.KindNATS, kitOptions{})
	e := newEnv(t)
	p := &parkCase{k: k, e: e, topic: uniqueName(t, "t"), group: uniqueName(t, "g"), tables: store.Tables{Schema: e.schema}}
	k.provision(t, p.topic, p.group)
	cfg := middleware.Config{Ordered: ptr(true), Workers: 4}
	fastRetry(&cfg, 2)
	handle := func(msg *message.Message) error {
		if err := p.fails(msg); err != nil {
			return err
		}
		return e.write(msg.Context(), p.group, msg)
	}
	// One consumer while a1's events arrive (two stock subscriptions would
	// take them in parallel, out of order, before any park): v2 is
	// poisoned, v3-v30 parked. The second joins before the release.
	consumers := []*testConsumer{startConsumer(t, k, e, cfg, handlerSpec{name: "h", topic: p.topic, group: p.group, handle: handle})}
	for v := 1; v <= 30; v++ {
		publish(t, k.pub, p.topic, event(fmt.Sprintf("%s-a1-%d", p.topic, v), "a1", int64(v), "{}"))
	}
	require.Eventually(t, func() bool {
		return e.count(t, `SELECT count(DISTINCT message_id) FROM `+e.table("millrace_parked")) == 29
	}, 30*time.Second, 20*time.Millisecond, "a1 v2 held, v3-v30 parked")
	consumers = append(consumers, startConsumer(t, k, e, cfg, handlerSpec{name: "h", topic: p.topic, group: p.group, handle: handle}))
	p.fixed.Store(true)
	require.NoError(t, p.tables.ReleaseParks(context.Background(), e.db, []int64{p.poisonID(t, "-a1-2")}, false))
	p.waitFor(t, 30)
	want := make([]string, 30)
	for i := range want {
		want[i] = fmt.Sprint(i + 1)
	}
	require.Equal(t, strings.Join(want, ","), p.versions(t, "a1"))
	drained := 0.0
	for _, c := range consumers {
		drained += c.messages(t, "h", middleware.OutcomeOK)
	}
	require.Equal(t, 30.0, drained, "one effect per event, duplicates none")
}

// A redelivery of the poisoned message (its ack lost in a crash) is parked
// behind it; a skip drops it with the head, a replay keeps it (the inbox
// absorbs it). One that comes later still is dropped once skipped.
func TestParkSkipDropsCopiesOfTheSkippedMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tables := store.Tables{Schema: e.schema}
	ctx := context.Background()
	var poisonIDs []int64
	for _, key := range []string{"skipped", "replayed"} {
		k := store.ParkKey{Group: "g", Handler: "h", Key: key}
		tx, err := e.db.Begin()
		require.NoError(t, err)
		now := time.Now()
		require.NoError(t, tables.StorePoisonedParked(ctx, tx, store.Poisoned{ConsumerGroup: "g", Handler: "h", SourceTopic: "t",
			MessageID: key + "-m0", Metadata: map[string]string{}, ErrorClass: middleware.ClassPermanent, Attempts: 1,
			FirstFailureAt: now, LastFailureAt: now, PoisonedAt: now}, k, store.ParkedMessage{MessageID: key + "-m0"}))
		require.NoError(t, tx.Commit())
		for _, id := range []string{key + "-m0", key + "-m1"} { // the redelivered poisoned message, then the next
			did, err := tables.AppendParked(ctx, e.db, k, store.ParkedMessage{MessageID: id})
			require.NoError(t, err)
			require.Equal(t, store.Parked, did)
		}
		var id int64
		require.NoError(t, e.db.QueryRow(`SELECT id FROM `+e.table("millrace_poison")+` WHERE message_id = $1`, key+"-m0").Scan(&id))
		poisonIDs = append(poisonIDs, id)
	}
	require.NoError(t, tables.ReleaseParks(ctx, e.db, poisonIDs[:1], true))
	require.NoError(t, tables.ReleaseParks(ctx, e.db, poisonIDs[1:], false))
	left := func(key string) string {
		var s string
		require.NoError(t, e.db.QueryRow(`SELECT string_agg(message_id, ',' ORDER BY pos) FROM `+e.table("millrace_parked")+
			` WHERE order_key = $1 AND NOT held`, key).Scan(&s))
		return s
	}
	require.Equal(t, "skipped-m1", left("skipped"))
	require.Equal(t, "replayed-m0,replayed-m0,replayed-m1", left("replayed"))
	// A later redelivery of the skipped message, parked key or not, is to
	// be dropped; the replayed one's goes on.
	for key, want := range map[string]store.Appended{"skipped": store.SkippedMessage, "other": store.SkippedMessage} {
		did, err := tables.AppendParked(ctx, e.db, store.ParkKey{Group: "g", Handler: "h", Key: key}, store.ParkedMessage{MessageID: "skipped-m0"})
		require.NoError(t, err)
		require.Equal(t, want, did, key)
	}
	did, err := tables.AppendParked(ctx, e.db, store.ParkKey{Group: "g", Handler: "h", Key: "other"}, store.ParkedMessage{MessageID: "replayed-m0"})
	require.NoError(t, err)
	require.Equal(t, store.NotParked, did)
	require.Equal(t, "skipped-m1", left("skipped"), "the redelivery was not parked")
}
