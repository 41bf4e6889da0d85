package bus_test

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// unusual is one member of a class of unusual input: an event (on the
// test's topic unless topic is set) and the brokers that must refuse it at
// Publish. Every other broker must deliver it byte for byte.
type unusual struct {
	name      string
	topic     string
	event     bus.Event
	refusedOn []string
}

var everyBroker = brokertest.Kinds

// Size limits the test configures on every broker, so that the brokers'
// own size rules are exercised with small messages.
const (
	testKafkaMaxBytes  = 2048
	testRabbitMaxBytes = 2048
	testNATSMaxMsgSize = 2048
)

// unusualInput lists the classes of input Publish either refuses with a
// typed error or delivers intact: white space, control characters and
// invalid UTF-8 in every id and header, names each broker reserves or
// cannot carry, topics with empty tokens or over-long derived names,
// times outside RFC 3339 and sizes around each broker's limit.
func unusualInput(topic string) []unusual {
	var u unusualCases
	u.ids()
	u.metadataKeys()
	u.metadataValues()
	u.topics(topic)
	u.times()
	u.sizes()
	return u.cases
}

// unusualCases collects the cases of unusualInput, each with its own tag.
type unusualCases struct {
	cases []unusual
	n     int
}

// tag is a string no other case has.
func (u *unusualCases) tag() string { u.n++; return fmt.Sprintf("u%03d", u.n) }

// base is an ordinary event.
func (u *unusualCases) base() bus.Event {
	return bus.Event{Type: "Unusual", AggregateType: "thing", AggregateID: "a-1", Payload: []byte(`{"ok":true}`)}
}

// add adds a case refused on the brokers refusedOn (none: delivered).
func (u *unusualCases) add(name string, e bus.Event, refusedOn ...string) {
	u.cases = append(u.cases, unusual{name: name, event: e, refusedOn: refusedOn})
}

// addTopic adds a case of an ordinary event on topic.
func (u *unusualCases) addTopic(name, topic string, refusedOn ...string) {
	u.cases = append(u.cases, unusual{name: name, topic: topic, event: u.base(), refusedOn: refusedOn})
}

// ids: every field carried as a header and stored as text.
func (u *unusualCases) ids() {
	fields := map[string]func(*bus.Event, string){
		"ID":            func(e *bus.Event, v string) { e.ID = v },
		"Type":          func(e *bus.Event, v string) { e.Type = v },
		"AggregateType": func(e *bus.Event, v string) { e.AggregateType = v },
		"AggregateID":   func(e *bus.Event, v string) { e.AggregateID = v },
		"CorrelationID": func(e *bus.Event, v string) { e.CorrelationID = v },
		"CausationID":   func(e *bus.Event, v string) { e.CausationID = v },
	}
	refusedText := []string{
		"%s\rA", "%s\nA", "%s\r\nA", "%s\tA", " %s", "%s ", "\u00a0%s", "%s\u2028", "%s\u3000",
		"%s\x00", "%s\x01", "%s\x7f", "%s\u0085", "%s\xff", "%s\xc3", "\xed\xa0\x80%s", "%s\xf4\x90\x80\x80",
	}
	deliveredText := []string{
		"%s A", "%s  A", "%s\u00a0A", "ключ-Ω-🙂-%s", "=?utf-8?b?eA==?=%s", "=?utf-8?b?%s?=", "a:b;c,d/%s",
		"%s\u200bz", "%s\"'`$(x)", strings.Repeat("é", 58) + "%s",
	}
	for _, name := range []string{"ID", "Type", "AggregateType", "AggregateID", "CorrelationID", "CausationID"} {
		for _, pattern := range refusedText {
			e := u.base()
			fields[name](&e, fmt.Sprintf(pattern, u.tag()))
			u.add(fmt.Sprintf("%s %q", name, pattern), e, everyBroker...)
		}
		for _, pattern := range deliveredText {
			e := u.base()
			fields[name](&e, fmt.Sprintf(pattern, u.tag()))
			u.add(fmt.Sprintf("%s %q", name, pattern), e)
		}
	}
}

// metadataKeys: keys every broker refuses, keys one broker reserves or
// cannot carry, and ordinary ones.
func (u *unusualCases) metadataKeys() {
	withKey := func(k string) bus.Event { e := u.base(); e.Metadata = map[string]string{k: "v"}; return e }
	for _, k := range []string{"", "k\x00", "k\xff", "k\n", " k", "k ", bus.EventIDKey, bus.AggregateIDKey,
		"replay-of", "poison-reason", "poisoned-at", "_watermill_message_uuid"} {
		u.add(fmt.Sprintf("metadata key %q", k), withKey(k), everyBroker...)
	}
	natsOnly := []string{"my key", "a:b", "ключ", "Nats-Rollup", "nats-msg-id", "k/v", "k=v", "k@host"}
	rabbitOnly := []string{"x-death", "x-delivery-count", "X-Death", "x-first-death-queue", "x-received-from",
		"CC", "bcc", "x-delay", "x-opt-filter", strings.Repeat("k", 256)}
	for _, k := range natsOnly {
		u.add(fmt.Sprintf("metadata key %q", k), withKey(k), bus.KindNATS)
	}
	for _, k := range rabbitOnly {
		u.add(fmt.Sprintf("metadata key %.20q", k), withKey(k), bus.KindRabbitMQ)
	}
	for _, k := range []string{"x-request-id", "tenant", "Mixed-Case", "k.v_w-1", "X-Custom"} {
		u.add(fmt.Sprintf("metadata key %q", k), withKey(k))
	}
}

// withValue is an ordinary event with metadata value v.
func (u *unusualCases) withValue(v string) bus.Event {
	e := u.base()
	e.Metadata = map[string]string{"note": v}
	return e
}

// metadataValues: values no broker carries, and awkward ones they all do.
func (u *unusualCases) metadataValues() {
	for _, v := range []string{"\x00", "a\x00b", "a\xffb", "\xc3"} {
		u.add(fmt.Sprintf("metadata value %q", v), u.withValue(v), everyBroker...)
	}
	for _, v := range []string{" lead", "trail ", " both ", "a\r\nb", "\t", "\n", "", "=?utf-8?b?Zm9v?=",
		"=?utf-8?b?not base64?=", "ключ 🙂", "\x01\x1f\x7f", "a, b", `{"json":[1,2]}`} {
		u.add(fmt.Sprintf("metadata value %q", v), u.withValue(v))
	}
}

// topics: wildcards, empty tokens, white space, and names around the
// longest RabbitMQ carries.
func (u *unusualCases) topics(topic string) {
	for _, tp := range []string{topic + ".*", topic + ".>", "." + topic, topic + " x", topic + "\n"} {
		u.addTopic(fmt.Sprintf("topic %q", tp), tp, everyBroker...)
	}
	for _, tp := range []string{topic + "..x", topic + "."} {
		u.addTopic(fmt.Sprintf("topic %q", tp), tp, bus.KindNATS)
	}
	long := topic + "." + strings.Repeat("l", 245-len(topic)-1) // 245 bytes: "<topic>::unrouted" is 255
	u.addTopic("topic of 245 bytes", long)
	u.addTopic("topic of 246 bytes", long+"l", bus.KindRabbitMQ)
}

// times: outside RFC 3339, and at its edges.
func (u *unusualCases) times() {
	at := func(t time.Time) bus.Event { e := u.base(); e.OccurredAt = t; return e }
	for _, tm := range []time.Time{time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(-1, 12, 31, 0, 0, 0, 0, time.UTC)} {
		u.add("occurred at "+tm.String(), at(tm), everyBroker...)
	}
	for _, tm := range []time.Time{time.Date(0, 1, 1, 0, 0, 0, 1, time.UTC), time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC),
		time.Date(2026, 3, 29, 2, 30, 0, 0, time.FixedZone("odd", 5*3600+45*60))} {
		u.add("occurred at "+tm.String(), at(tm))
	}
}

// sizes: around each broker's configured limit (testKafkaMaxBytes, ...).
func (u *unusualCases) sizes() {
	payload := func(size int) bus.Event {
		e := u.base()
		e.Payload = []byte(`"` + strings.Repeat("p", size-2) + `"`)
		return e
	}
	u.add("payload of 1200 bytes", payload(1200))
	u.add("payload of 2100 bytes", payload(2100), everyBroker...)
	u.add("metadata of 2100 bytes", u.withValue(strings.Repeat("v", 2100)), bus.KindKafka, bus.KindNATS)
}

// Every input Publish accepts reaches the consumer byte for byte, on every
// broker; everything else is refused at the call with a typed error naming
// the field, and nothing of it is written.
func TestUnusualInputIsRefusedOrDeliveredIntact(t *testing.T) {
	t.Parallel()
	brokertest.EachKind(t, testUnusualInput)
}

// unusualRig is one broker's service publishing the unusual cases.
type unusualRig struct {
	kindRig
	schema   string
	b        *bus.Bus
	topic    string
	mu       sync.Mutex
	got      map[string][]bus.Event // event id -> deliveries
	handled  map[string]bool        // topics with a handler
	accepted map[string]unusual     // event id -> case
}

func testUnusualInput(t *testing.T, kind string) {
	r := newUnusualRig(t, kind)
	cases := unusualInput(r.topic)
	for _, c := range cases {
		r.publish(c)
	}
	var rows int
	require.NoError(t, r.db.QueryRow(`SELECT count(*) FROM "`+r.schema+`".watermill_millrace_outbox`).Scan(&rows))
	require.Equal(t, len(r.accepted), rows, "every refused event wrote nothing")
	t.Logf("%s: %d cases, %d accepted, %d refused", kind, len(cases), len(r.accepted), len(cases)-len(r.accepted))

	running := testkit.Start(t, r.b.Run)
	t.Cleanup(func() { require.NoError(t, running.Stop(t, time.Minute)) })
	r.waitArrived()
	r.checkIntact()
}

// newUnusualRig opens a service on kind with small size limits.
func newUnusualRig(t *testing.T, kind string) *unusualRig {
	s := brokertest.NewService(t, kind, func(cfg *bus.Config) {
		cfg.Broker.Kafka.MaxMessageBytes = testKafkaMaxBytes
		cfg.Broker.RabbitMQ.MaxMessageBytes = testRabbitMaxBytes
		cfg.Broker.NATS.Stream.MaxMsgSize = testNATSMaxMsgSize
		cfg.Relay.PollInterval = 100 * time.Millisecond
	})
	return &unusualRig{kindRig: kindRig{t, kind, s.DB}, schema: s.Config.Database.Schema, b: s.Open(t),
		topic: "unusual-_" + testkit.Suffix(),
		got:   map[string][]bus.Event{}, handled: map[string]bool{}, accepted: map[string]unusual{}}
}

// publish publishes c in its own transaction: refused with a typed error
// where c says so, else accepted, its topic handled and its id recorded.
func (r *unusualRig) publish(c unusual) {
	t, ctx := r.t, context.Background()
	tp := cmp.Or(c.topic, r.topic)
	tx, err := r.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	err = r.b.Publish(ctx, tx, tp, c.event)
	require.NoError(t, tx.Commit(), "%s: the caller's transaction stays usable", c.name)
	if slices.Contains(c.refusedOn, r.kind) {
		require.Error(t, err, "%s: must be refused on %s", c.name, r.kind)
		var ee *bus.EventError
		if !errors.As(err, &ee) {
			require.ErrorIs(t, err, bus.ErrInvalidTopic, "%s: a typed error", c.name)
		} else {
			require.NotEmpty(t, ee.Field, "%s: the error names the field", c.name)
		}
		return
	}
	require.NoError(t, err, "%s: must be accepted on %s", c.name, r.kind)
	if !r.handled[tp] {
		r.handle(tp, c.name)
	}
	id := c.event.ID
	if id == "" {
		// Publish gave it an id: find it through its unique case.
		id = lastEventID(t, r.db, r.schema)
	}
	require.NotContains(t, r.accepted, id, "%s: ids are distinct", c.name)
	r.accepted[id] = c
}

// handle registers a handler of tp that records every delivery.
func (r *unusualRig) handle(tp, caseName string) {
	r.handled[tp] = true
	brokertest.Cleanup(r.t, r.kind, tp, fmt.Sprintf("c%d", len(r.handled)))
	name := fmt.Sprintf("c%d", len(r.handled)) // short: RabbitMQ queue names of the 245-byte topic must fit
	require.NoError(r.t, r.b.Handle(tp, name, func(_ context.Context, ev bus.Event) error {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.got[ev.ID] = append(r.got[ev.ID], ev)
		return nil
	}), caseName)
}

// waitArrived waits until every accepted event arrived; it fails with
// what the relay quarantined when they do not.
func (r *unusualRig) waitArrived() {
	t := r.t
	deadline := time.Now().Add(2 * time.Minute)
	for {
		r.mu.Lock()
		arrived := 0
		for id := range r.accepted {
			if len(r.got[id]) > 0 {
				arrived++
			}
		}
		r.mu.Unlock()
		if arrived == len(r.accepted) {
			return
		}
		if time.Now().After(deadline) {
			var quarantined []string
			qr, err := r.db.Query(`SELECT reason FROM "` + r.schema + `".millrace_relay_quarantine`)
			require.NoError(t, err)
			for qr.Next() {
				var reason string
				require.NoError(t, qr.Scan(&reason))
				quarantined = append(quarantined, reason)
			}
			require.FailNow(t, "accepted events lost", "%s: %d of %d arrived; quarantined: %q", r.kind, arrived, len(r.accepted), quarantined)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkIntact: every accepted event arrived byte for byte, and the relay
// set nothing aside.
func (r *unusualRig) checkIntact() {
	t := r.t
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, c := range r.accepted {
		ev := r.got[id][0]
		want := c.event
		require.Equal(t, id, ev.ID, c.name)
		require.Equal(t, want.Type, ev.Type, c.name)
		require.Equal(t, want.AggregateType, ev.AggregateType, c.name)
		require.Equal(t, want.AggregateID, ev.AggregateID, c.name)
		require.Equal(t, want.CorrelationID, ev.CorrelationID, c.name)
		require.Equal(t, want.CausationID, ev.CausationID, c.name)
		require.Equal(t, want.Payload, ev.Payload, c.name)
		if !want.OccurredAt.IsZero() {
			require.True(t, want.OccurredAt.Equal(ev.OccurredAt), "%s: occurred at %s, got %s", c.name, want.OccurredAt, ev.OccurredAt)
		}
		for k, v := range want.Metadata {
			require.Contains(t, ev.Metadata, k, c.name)
			require.Equal(t, v, ev.Metadata[k], c.name)
		}
	}
	var quarantined int
	require.NoError(t, r.db.QueryRow(`SELECT count(*) FROM "`+r.schema+`".millrace_relay_quarantine`).Scan(&quarantined))
	require.Zero(t, quarantined, "nothing Publish accepted was set aside by the relay")
}

// lastEventID is the event id of the newest outbox row.
func lastEventID(t *testing.T, db *sql.DB, schema string) string {
	t.Helper()
	var id string
	require.NoError(t, db.QueryRow(`SELECT payload::json->>'uuid' FROM "`+schema+`".watermill_millrace_outbox ORDER BY "offset" DESC LIMIT 1`).Scan(&id))
	return id
}
