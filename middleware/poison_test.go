package middleware_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
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
