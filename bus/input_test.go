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
	"github.com/millrace-io/millrace/internal/testing/testdb"
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
	var cases []unusual
	n := 0
	tag := func() string { n++; return fmt.Sprintf("u%03d", n) }
	base := func() bus.Event {
		return bus.Event{Type: "Unusual", AggregateType: "thing", AggregateID: "a-1", Payload: []byte(`{"ok":true}`)}
	}

	// Ids and names: every field carried as a header and stored as text.
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
			e := base()
			fields[name](&e, fmt.Sprintf(pattern, tag()))
			cases = append(cases, unusual{name: fmt.Sprintf("%s %q", name, pattern), event: e, refusedOn: everyBroker})
		}
		for _, pattern := range deliveredText {
			e := base()
			fields[name](&e, fmt.Sprintf(pattern, tag()))
			cases = append(cases, unusual{name: fmt.Sprintf("%s %q", name, pattern), event: e})
		}
	}

	// Metadata keys.
	withKey := func(k string) bus.Event { e := base(); e.Metadata = map[string]string{k: "v"}; return e }
	for _, k := range []string{"", "k\x00", "k\xff", "k\n", " k", "k ", bus.EventIDKey, bus.AggregateIDKey,
		"replay-of", "poison-reason", "poisoned-at", "_watermill_message_uuid"} {
		cases = append(cases, unusual{name: fmt.Sprintf("metadata key %q", k), event: withKey(k), refusedOn: everyBroker})
	}
	natsOnly := []string{"my key", "a:b", "ключ", "Nats-Rollup", "nats-msg-id", "k/v", "k=v", "k@host"}
	rabbitOnly := []string{"x-death", "x-delivery-count", "X-Death", "x-first-death-queue", "x-received-from",
		"CC", "bcc", "x-delay", "x-opt-filter", strings.Repeat("k", 256)}
	for _, k := range natsOnly {
		cases = append(cases, unusual{name: fmt.Sprintf("metadata key %q", k), event: withKey(k), refusedOn: []string{bus.KindNATS}})
	}
	for _, k := range rabbitOnly {
		cases = append(cases, unusual{name: fmt.Sprintf("metadata key %.20q", k), event: withKey(k), refusedOn: []string{bus.KindRabbitMQ}})
	}
	for _, k := range []string{"x-request-id", "tenant", "Mixed-Case", "k.v_w-1", "X-Custom"} {
		cases = append(cases, unusual{name: fmt.Sprintf("metadata key %q", k), event: withKey(k)})
	}

	// Metadata values.
	withValue := func(v string) bus.Event { e := base(); e.Metadata = map[string]string{"note": v}; return e }
	for _, v := range []string{"\x00", "a\x00b", "a\xffb", "\xc3"} {
		cases = append(cases, unusual{name: fmt.Sprintf("metadata value %q", v), event: withValue(v), refusedOn: everyBroker})
	}
	for _, v := range []string{" lead", "trail ", " both ", "a\r\nb", "\t", "\n", "", "=?utf-8?b?Zm9v?=",
		"=?utf-8?b?not base64?=", "ключ 🙂", "\x01\x1f\x7f", "a, b", `{"json":[1,2]}`} {
		cases = append(cases, unusual{name: fmt.Sprintf("metadata value %q", v), event: withValue(v)})
	}

	// Topics.
	for _, tp := range []string{topic + ".*", topic + ".>", "." + topic, topic + " x", topic + "\n"} {
		cases = append(cases, unusual{name: fmt.Sprintf("topic %q", tp), topic: tp, event: base(), refusedOn: everyBroker})
	}
	for _, tp := range []string{topic + "..x", topic + "."} {
		cases = append(cases, unusual{name: fmt.Sprintf("topic %q", tp), topic: tp, event: base(), refusedOn: []string{bus.KindNATS}})
	}
	long := topic + "." + strings.Repeat("l", 245-len(topic)-1) // 245 bytes: "<topic>::unrouted" is 255
	cases = append(cases, unusual{name: "topic of 245 bytes", topic: long, event: base()})
	cases = append(cases, unusual{name: "topic of 246 bytes", topic: long + "l", event: base(), refusedOn: []string{bus.KindRabbitMQ}})

	// Times.
	at := func(t time.Time) bus.Event { e := base(); e.OccurredAt = t; return e }
	for _, tm := range []time.Time{time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(-1, 12, 31, 0, 0, 0, 0, time.UTC)} {
		cases = append(cases, unusual{name: "occurred at " + tm.String(), event: at(tm), refusedOn: everyBroker})
	}
	for _, tm := range []time.Time{time.Date(0, 1, 1, 0, 0, 0, 1, time.UTC), time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC),
		time.Date(2026, 3, 29, 2, 30, 0, 0, time.FixedZone("odd", 5*3600+45*60))} {
		cases = append(cases, unusual{name: "occurred at " + tm.String(), event: at(tm)})
	}

	// Sizes around each broker's configured limit (testKafkaMaxBytes, ...).
	payload := func(size int) bus.Event {
		e := base()
		e.Payload = []byte(`"` + strings.Repeat("p", size-2) + `"`)
		return e
	}
	cases = append(cases,
		unusual{name: "payload of 1200 bytes", event: payload(1200)},
		unusual{name: "payload of 2100 bytes", event: payload(2100), refusedOn: everyBroker},
	)
	bigValue := withValue(strings.Repeat("v", 2100))
	cases = append(cases, unusual{name: "metadata of 2100 bytes", event: bigValue, refusedOn: []string{bus.KindKafka, bus.KindNATS}})
	return cases
}

// Every input Publish accepts reaches the consumer byte for byte, on every
// broker; everything else is refused at the call with a typed error naming
// the field, and nothing of it is written.
func TestUnusualInputIsRefusedOrDeliveredIntact(t *testing.T) {
	t.Parallel()
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			testUnusualInput(t, kind)
		})
	}
}

func testUnusualInput(t *testing.T, kind string) {
	ctx := context.Background()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, kind, &cfg)
	cfg.Broker.Kafka.MaxMessageBytes = testKafkaMaxBytes
	cfg.Broker.RabbitMQ.MaxMessageBytes = testRabbitMaxBytes
	cfg.Broker.NATS.Stream.MaxMsgSize = testNATSMaxMsgSize
	cfg.Relay.PollInterval = 100 * time.Millisecond
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	b, err := bus.Open(ctx, cfg, db)
	require.NoError(t, err)
	defer b.Close()

	topic := "unusual-" + testdb.UniqueName("")[2:]
	cases := unusualInput(topic)

	var mu sync.Mutex
	got := map[string][]bus.Event{} // event id -> deliveries
	handled := map[string]bool{}
	accepted := map[string]unusual{} // event id -> case
	for _, c := range cases {
		tp := cmp.Or(c.topic, topic)
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		err = b.Publish(ctx, tx, tp, c.event)
		require.NoError(t, tx.Commit(), "%s: the caller's transaction stays usable", c.name)
		if slices.Contains(c.refusedOn, kind) {
			require.Error(t, err, "%s: must be refused on %s", c.name, kind)
			var ee *bus.EventError
			if !errors.As(err, &ee) {
				require.ErrorIs(t, err, bus.ErrInvalidTopic, "%s: a typed error", c.name)
			} else {
				require.NotEmpty(t, ee.Field, "%s: the error names the field", c.name)
			}
			continue
		}
		require.NoError(t, err, "%s: must be accepted on %s", c.name, kind)
		if !handled[tp] {
			handled[tp] = true
			brokertest.Cleanup(t, kind, tp, fmt.Sprintf("c%d", len(handled)))
			name := fmt.Sprintf("c%d", len(handled)) // short: RabbitMQ queue names of the 245-byte topic must fit
			require.NoError(t, b.Handle(tp, name, func(_ context.Context, ev bus.Event) error {
				mu.Lock()
				defer mu.Unlock()
				got[ev.ID] = append(got[ev.ID], ev)
				return nil
			}), c.name)
		}
		id := c.event.ID
		if id == "" {
			// Publish gave it an id: find it through its unique case.
			id = lastEventID(t, db, cfg.Database.Schema)
		}
		require.NotContains(t, accepted, id, "%s: ids are distinct", c.name)
		accepted[id] = c
	}
	var rows int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".watermill_millrace_outbox`).Scan(&rows))
	require.Equal(t, len(accepted), rows, "every refused event wrote nothing")
	t.Logf("%s: %d cases, %d accepted, %d refused", kind, len(cases), len(accepted), len(cases)-len(accepted))

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	defer func() {
		stop()
		require.NoError(t, <-done)
	}()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		mu.Lock()
		arrived := 0
		for id := range accepted {
			if len(got[id]) > 0 {
				arrived++
			}
		}
		mu.Unlock()
		if arrived == len(accepted) {
			break
		}
		if time.Now().After(deadline) {
			var quarantined []string
			qr, err := db.Query(`SELECT reason FROM "` + cfg.Database.Schema + `".millrace_relay_quarantine`)
			require.NoError(t, err)
			for qr.Next() {
				var r string
				require.NoError(t, qr.Scan(&r))
				quarantined = append(quarantined, r)
			}
			require.FailNow(t, "accepted events lost", "%s: %d of %d arrived; quarantined: %q", kind, arrived, len(accepted), quarantined)
		}
		time.Sleep(50 * time.Millisecond)
	}

	mu.Lock()
	defer mu.Unlock()
	for id, c := range accepted {
		ev := got[id][0]
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
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".millrace_relay_quarantine`).Scan(&quarantined))
	require.Zero(t, quarantined, "nothing Publish accepted was set aside by the relay")
}

// lastEventID is the event id of the newest outbox row.
func lastEventID(t *testing.T, db *sql.DB, schema string) string {
	t.Helper()
	var id string
	require.NoError(t, db.QueryRow(`SELECT payload::json->>'uuid' FROM "`+schema+`".watermill_millrace_outbox ORDER BY "offset" DESC LIMIT 1`).Scan(&id))
	return id
}
