package middleware_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

// order is the payload the poison tests' handler decodes.
type order struct {
	Amount int `json:"amount"`
}

// poisonRow is a row of the poison table.
type poisonRow struct {
	group, handler, topic, messageID, eventID, eventType string
	payload                                              []byte
	metadata                                             map[string]string
	reason, class                                        string
	attempts, times                                      int
	first, last, at                                      time.Time
	traceparent                                          string
}

func (e *env) poisoned(t testing.TB) map[string]poisonRow {
	t.Helper()
	rows, err := e.db.Query(`SELECT consumer_group, handler, source_topic, message_id, event_id, event_type, payload, metadata,
		reason, error_class, attempts, times_poisoned, first_failure_at, last_failure_at, poisoned_at, traceparent FROM ` + e.table("millrace_poison"))
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]poisonRow{}
	for rows.Next() {
		var r poisonRow
		var meta []byte
		require.NoError(t, rows.Scan(&r.group, &r.handler, &r.topic, &r.messageID, &r.eventID, &r.eventType, &r.payload, &meta,
			&r.reason, &r.class, &r.attempts, &r.times, &r.first, &r.last, &r.at, &r.traceparent))
		require.NoError(t, json.Unmarshal(meta, &r.metadata))
		out[r.messageID] = r
	}
	require.NoError(t, rows.Err())
	return out
}

// attemptCounter counts handler calls per event id.
type attemptCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (a *attemptCounter) next(id string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.n == nil {
		a.n = map[string]int{}
	}
	a.n[id]++
	return a.n[id]
}

func (a *attemptCounter) get(id string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n[id]
}

// Bad messages are poisoned with their failure envelope, transient failures
// are retried, and the events behind a poisoned message (the same aggregate
// included, in ordered mode) keep flowing, on every broker.
func TestPoisonQueue(t *testing.T) {
	t.Parallel()
	testkit.Each(t, kitNames, func(t *testing.T, name string) {
		testPoisonQueue(t, name)
	})
}

func testPoisonQueue(t *testing.T, name string) {
	e, k, topic, group := newBilling(t, name, kitOptions{})

	var attempts attemptCounter
	handle := func(msg *message.Message) error {
		id := msg.Metadata.Get(bus.EventIDKey)
		n := attempts.next(id)
		if err := middleware.CheckSchemaVersion(msg, 1, 2); err != nil {
			return err
		}
		var o order
		if err := middleware.DecodeJSON(msg, &o); err != nil {
			return err
		}
		switch {
		case o.Amount < 0:
			return bus.Permanent(errors.New("order total is negative"))
		case id == "flaky" && n < 3:
			return fmt.Errorf("payment service timeout (attempt %d)", n)
		case id == "broken":
			return errors.New("payment service returned 503")
		}
		return e.write(msg.Context(), group, msg)
	}
	// Parking off: the later events of o-1 and o-2 flow past the poisoned
	// ones (park_test.go has the parked case).
	cfg := middleware.Config{Ordered: new(true), Breaker: middleware.BreakerConfig{ConsecutiveFailures: 50},
		Poison: middleware.PoisonConfig{Park: new(false)}}
	fastRetry(&cfg, 4)
	publish(t, k.pub, topic, poisonQueueEvents()...)
	c := startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: handle})

	testkit.Eventually(t, time.Minute, "20 good events and flaky processed, 7 poisoned", func() bool {
		return c.messages(t, "billing", middleware.OutcomeOK) == 21 && c.messages(t, "billing", middleware.OutcomePoisoned) == 7
	})
	require.Equal(t, 21, e.rows(t, "business", ""))
	require.Equal(t, 3, attempts.get("flaky"), "flaky cleared on attempt 3")
	require.Equal(t, 4, attempts.get("broken"), "broken tried retry.max_attempts times")
	require.Equal(t, 1, attempts.get("refused"), "a permanent error is not retried")
	require.Zero(t, attempts.get("malformed"), "malformed JSON never reaches the handler")
	require.EqualValues(t, 2+3, c.messages(t, "billing", middleware.OutcomeRetried))
	checkPoisonRows(t, e.poisoned(t), topic, group)
}

// poisonQueueEvents are TestPoisonQueue's events: eight bad or flaky ones,
// then 20 good ones of the same two aggregates.
func poisonQueueEvents() []*message.Message {
	malformed := event("malformed", "o-1", 1, `{"amount":`)
	unknownVersion := event("unknown-version", "o-1", 2, `{"amount":5}`)
	unknownVersion.Metadata.Set(bus.SchemaVersionKey, "7")
	refused := event("refused", "o-1", 3, `{"amount":-5}`)
	flaky := event("flaky", "o-1", 4, `{"amount":1}`)
	broken := event("broken", "o-1", 5, `{"amount":1}`)
	wrongType := event("wrong-type", "o-2", 1, `{"amount":"ten"}`)
	noID := event("", "o-2", 2, `{"amount":1}`)
	delete(noID.Metadata, bus.EventIDKey)
	bigMeta := event("big-metadata", "o-2", 3, `{"amount":1}`)
	bigMeta.Metadata.Set("x-note", strings.Repeat("x", 20000))
	msgs := []*message.Message{malformed, unknownVersion, refused, flaky, broken, wrongType, noID, bigMeta}
	for i := range 20 {
		msgs = append(msgs, event(fmt.Sprintf("after-%02d", i), fmt.Sprintf("o-%d", 1+i%2), int64(10+i), `{"amount":1}`))
	}
	return msgs
}

// checkPoisonRows checks the poison rows of TestPoisonQueue's seven bad
// events.
func checkPoisonRows(t *testing.T, rows map[string]poisonRow, topic, group string) {
	require.Len(t, rows, 7)
	want := map[string]struct {
		class, reason string
		attempts      int
	}{
		"malformed":       {middleware.ClassPermanent, "invalid payload: not valid JSON", 1},
		"unknown-version": {middleware.ClassPermanent, "invalid metadata.schema-version: unknown schema version 7", 1},
		"refused":         {middleware.ClassPermanent, "order total is negative", 1},
		"broken":          {middleware.ClassTransient, "4 attempts failed, last: payment service returned 503", 4},
		"wrong-type":      {middleware.ClassPermanent, "invalid payload.amount: expected int", 1},
		"big-metadata":    {middleware.ClassPermanent, "invalid metadata: ", 1},
	}
	for id, w := range want {
		r, ok := rows[id]
		require.True(t, ok, "%s poisoned", id)
		require.Equal(t, w.class, r.class, id)
		require.Contains(t, r.reason, w.reason, id)
		require.Equal(t, w.attempts, r.attempts, id)
		require.Equal(t, group, r.group, id)
		require.Equal(t, "billing", r.handler, id)
		require.Equal(t, topic, r.topic, id)
		require.Equal(t, id, r.eventID, id)
		require.Equal(t, "OrderPlaced", r.eventType, id)
		require.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", r.traceparent, id)
		require.Equal(t, 1, r.times, id)
		require.False(t, r.first.After(r.last), id)
		require.False(t, r.last.After(r.at), id)
		require.Equal(t, "order", r.metadata[bus.AggregateTypeKey], id)
		require.NotContains(t, r.metadata, "reason_poisoned", "Watermill's own keys are columns here")
	}
	require.Equal(t, `{"amount":`, string(rows["malformed"].payload))
	require.Greater(t, rows["broken"].last.Sub(rows["broken"].first), time.Duration(0), "the ladder spans time")
	require.Len(t, rows["big-metadata"].metadata["x-note"], 20000, "the metadata is stored whole")
	var missing poisonRow
	for _, r := range rows {
		if r.eventID == "" {
			missing = r
		}
	}
	require.Contains(t, missing.reason, "invalid metadata.event-id: missing")
	require.Equal(t, middleware.ClassPermanent, missing.class)
}

// With poison.destination topic the poisoned message goes to the poison
// topic through the caller's publisher, with the failure envelope as metadata.
func TestPoisonToTopic(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	k := gochannelKit(t)
	topic, group, poisonTopic := uniqueName(t, "orders"), uniqueName(t, "billing"), uniqueName(t, "poison")
	poisoned, err := k.pub.(*gochannel.GoChannel).Subscribe(t.Context(), poisonTopic)
	require.NoError(t, err)

	cfg := middleware.Config{Poison: middleware.PoisonConfig{Destination: middleware.PoisonToTopic, Topic: poisonTopic}}
	fastRetry(&cfg, 2)
	startConsumer(t, k, e, cfg, handlerSpec{name: "billing", topic: topic, group: group, handle: func(msg *message.Message) error {
		return errors.New("ledger unavailable")
	}})
	publish(t, k.pub, topic, event("evt-1", "o-1", 1, `{"amount":1}`))

	select {
	case msg := <-poisoned:
		msg.Ack()
		require.Equal(t, "evt-1", msg.UUID)
		require.Equal(t, `{"amount":1}`, string(msg.Payload))
		md := msg.Metadata
		require.Equal(t, "2 attempts failed, last: ledger unavailable", md.Get(middleware.PoisonReasonKey))
		require.Equal(t, middleware.ClassTransient, md.Get(middleware.PoisonErrorClassKey))
		require.Equal(t, "2", md.Get(middleware.PoisonAttemptsKey))
		require.Equal(t, topic, md.Get(middleware.PoisonSourceTopicKey))
		require.Equal(t, "billing", md.Get(middleware.PoisonHandlerKey))
		require.Equal(t, group, md.Get(middleware.PoisonConsumerGroupKey))
		require.Equal(t, md.Get(bus.TraceparentKey), md.Get(middleware.PoisonTraceparentKey))
		first, err := time.Parse(time.RFC3339Nano, md.Get(middleware.PoisonFirstFailureKey))
		require.NoError(t, err)
		last, err := time.Parse(time.RFC3339Nano, md.Get(middleware.PoisonLastFailureKey))
		require.NoError(t, err)
		require.True(t, last.After(first))
		_, err = time.Parse(time.RFC3339Nano, md.Get(middleware.PoisonedAtKey))
		require.NoError(t, err)
		require.Equal(t, "evt-1", md.Get(bus.EventIDKey), "the original metadata travels along")
	case <-time.After(30 * time.Second):
		t.Fatal("nothing arrived on the poison topic")
	}
	require.Zero(t, e.rows(t, "millrace_poison", ""), "the table is not used")
	require.Zero(t, e.rows(t, "millrace_inbox", ""), "a poisoned message is not marked processed")
}

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
