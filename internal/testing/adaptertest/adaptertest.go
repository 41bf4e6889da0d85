package adaptertest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
)

// Harness describes the adapter under test.
type Harness struct {
	// NewBroker returns a connected Broker; the suite closes it.
	NewBroker func(t *testing.T) adapters.Broker
	// RestartBroker, when set, stops the broker server and starts it again,
	// returning when it accepts connections. The restart test runs only with it.
	RestartBroker func(t *testing.T)
	// MaxMessageBytes, when set, is the broker's message size limit: a larger
	// message must fail PublishBatch with a permanent error.
	MaxMessageBytes int
	// Timeout bounds each wait for messages. Defaults to 60s.
	Timeout time.Duration
}

// Run runs the whole suite. Tests that share the broker server run in
// parallel, each on its own topics and consumer groups.
func Run(t *testing.T, h Harness) {
	if h.Timeout == 0 {
		h.Timeout = 60 * time.Second
	}
	t.Run("BatchPublishConfirms", func(t *testing.T) { t.Parallel(); testBatchPublish(t, h) })
	t.Run("PerKeyOrder", func(t *testing.T) { t.Parallel(); testPerKeyOrder(t, h) })
	t.Run("ConsumerGroupFanOut", func(t *testing.T) { t.Parallel(); testFanOut(t, h) })
	t.Run("CompetingConsumers", func(t *testing.T) { t.Parallel(); testCompeting(t, h) })
	t.Run("RedeliveryAfterNack", func(t *testing.T) { t.Parallel(); testRedelivery(t, h) })
	t.Run("UnusualMessagesIntactOrRefused", func(t *testing.T) { t.Parallel(); testUnusual(t, h) })
	t.Run("SubscriberSpecByCapabilities", func(t *testing.T) { t.Parallel(); testSpecs(t, h) })
	t.Run("PingAndBacklogByCapabilities", func(t *testing.T) { t.Parallel(); testPingBacklog(t, h) })
	t.Run("DeprovisionRemovesTopology", func(t *testing.T) { t.Parallel(); testDeprovision(t, h) })
	t.Run("MessageTooLarge", func(t *testing.T) {
		if h.MaxMessageBytes == 0 {
			t.Skip("the harness sets no MaxMessageBytes for this broker")
		}
		t.Parallel()
		testTooLarge(t, h)
	})
	// The restart test runs after the parallel ones above have finished.
	t.Run("BrokerRestartLosesNothing", func(t *testing.T) {
		if h.RestartBroker == nil {
			t.Skip("the harness cannot restart this broker")
		}
		testRestart(t, h)
	})
}

// Name returns a unique topic or group name with prefix, valid on every broker.
func Name(prefix string) string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return prefix + "-" + hex.EncodeToString(b)
}

func newBroker(t *testing.T, h Harness) adapters.Broker {
	b := h.NewBroker(t)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	return b
}

// event builds a message the way the relay sends it: the event id as UUID
// and the envelope metadata.
func event(aggregate string, version int) *message.Message {
	id := Name("ev")
	msg := message.NewMessage(id, []byte(fmt.Sprintf(`{"aggregate":%q,"version":%d}`, aggregate, version)))
	msg.Metadata.Set(envelope.EventIDKey, id)
	msg.Metadata.Set(envelope.AggregateIDKey, aggregate)
	msg.Metadata.Set(envelope.AggregateVersionKey, strconv.Itoa(version))
	return msg
}

// Subscribe subscribes a Subscriber of group to topic until the test ends,
// when it closes the Subscriber and asserts that Close succeeded.
func Subscribe(t testing.TB, b adapters.Broker, topic, group string) <-chan *message.Message {
	t.Helper()
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); require.NoError(t, sub.Close()) })
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	return ch
}

// Receive acks and collects n messages from ch, failing after timeout or
// when ch closes first.
func Receive(t testing.TB, ch <-chan *message.Message, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	var got []*message.Message
	deadline := time.After(timeout)
	for len(got) < n {
		select {
		case m, ok := <-ch:
			require.True(t, ok, "subscription closed after %d of %d messages", len(got), n)
			got = append(got, m)
			m.Ack()
		case <-deadline:
			require.FailNow(t, "timeout", "received %d of %d messages", len(got), n)
		}
	}
	return got
}

// Next returns the next message of ch, unsettled, failing after timeout or
// when ch closes.
func Next(t testing.TB, ch <-chan *message.Message, timeout time.Duration) *message.Message {
	t.Helper()
	select {
	case m, ok := <-ch:
		require.True(t, ok, "subscription closed")
		return m
	case <-time.After(timeout):
		require.FailNow(t, "no message handed out", "within %s", timeout)
		return nil
	}
}

// Quiet asserts that nothing more arrives on ch for d.
func Quiet(t testing.TB, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case m := <-ch:
		m.Ack()
		require.FailNow(t, "unexpected extra message", "uuid %s", m.UUID)
	case <-time.After(d):
	}
}

// Outgoing returns msgs as a batch for PublishBatch, every one to topic.
func Outgoing(topic string, msgs ...*message.Message) []adapters.Outgoing {
	out := make([]adapters.Outgoing, len(msgs))
	for i, m := range msgs {
		out[i] = adapters.Outgoing{Topic: topic, Msg: m}
	}
	return out
}

func publishBatch(t *testing.T, b adapters.Broker, topic string, msgs []*message.Message) {
	t.Helper()
	require.NoError(t, b.PublishBatch(context.Background(), Outgoing(topic, msgs...)))
}

func testBatchPublish(t *testing.T, h Harness) {
	b := newBroker(t, h)
	topicA, topicB, group := Name("batch-a"), Name("batch-b"), Name("g")
	require.NoError(t, b.Provision(context.Background(), topicA, group))
	require.NoError(t, b.Provision(context.Background(), topicB, group))
	chA := Subscribe(t, b, topicA, group)
	chB := Subscribe(t, b, topicB, group)

	const n = 1000
	var batch []adapters.Outgoing
	want := map[string]string{}
	for i := range n {
		topic := topicA
		if i%3 == 0 {
			topic = topicB
		}
		m := event(fmt.Sprintf("agg-%d", i%17), i)
		want[m.UUID] = topic
		batch = append(batch, adapters.Outgoing{Topic: topic, Msg: m})
	}
	require.NoError(t, b.PublishBatch(context.Background(), batch))
	require.NoError(t, b.PublishBatch(context.Background(), nil), "an empty batch is a no-op")

	nB := (n + 2) / 3
	got := append(Receive(t, chA, n-nB, h.Timeout), Receive(t, chB, nB, h.Timeout)...)
	seen := map[string]bool{}
	for _, m := range got {
		require.False(t, seen[m.UUID], "duplicate %s", m.UUID)
		seen[m.UUID] = true
		_, ok := want[m.UUID]
		require.True(t, ok, "unknown message %s", m.UUID)
		require.Equal(t, m.UUID, m.Metadata.Get(envelope.EventIDKey), "metadata travels with the message")
	}
	require.Len(t, seen, n)
}

func testPerKeyOrder(t *testing.T, h Harness) {
	b := newBroker(t, h)
	topic, group := Name("order"), Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	ch := Subscribe(t, b, topic, group)

	const aggregates, versions = 100, 50
	// Versions interleave across aggregates, in batches of 500, as the relay sends them.
	var all []*message.Message
	for v := 1; v <= versions; v++ {
		for a := range aggregates {
			all = append(all, event(fmt.Sprintf("agg-%03d", a), v))
		}
	}
	for start := 0; start < len(all); start += 500 {
		publishBatch(t, b, topic, all[start:min(start+500, len(all))])
	}
	last := map[string]int{}
	seen := map[string]bool{}
	deadline := time.After(h.Timeout)
	for len(seen) < len(all) {
		var m *message.Message
		select {
		case next, ok := <-ch:
			require.True(t, ok, "subscription closed after %d of %d messages", len(seen), len(all))
			m = next
			m.Ack()
		case <-deadline:
			require.FailNow(t, "timeout", "received %d of %d messages", len(seen), len(all))
		}
		if seen[m.UUID] {
			// At least once: a message whose ack came after the broker's ack
			// wait (a loaded machine) is delivered again. Only a message not
			// seen before must be its aggregate's next version.
			continue
		}
		seen[m.UUID] = true
		agg := m.Metadata.Get(envelope.AggregateIDKey)
		v, err := strconv.Atoi(m.Metadata.Get(envelope.AggregateVersionKey))
		require.NoError(t, err)
		require.Equal(t, last[agg]+1, v, "aggregate %s: version %d after %d", agg, v, last[agg])
		last[agg] = v
	}
	require.Len(t, last, aggregates)
}

func testFanOut(t *testing.T, h Harness) {
	b := newBroker(t, h)
	topic, g1, g2 := Name("fanout"), Name("g1"), Name("g2")
	require.NoError(t, b.Provision(context.Background(), topic, g1, g2))
	ch1 := Subscribe(t, b, topic, g1)
	ch2 := Subscribe(t, b, topic, g2)
	var msgs []*message.Message
	for i := range 100 {
		msgs = append(msgs, event(fmt.Sprintf("agg-%d", i), 1))
	}
	publishBatch(t, b, topic, msgs)
	for _, ch := range []<-chan *message.Message{ch1, ch2} {
		got := Receive(t, ch, len(msgs), h.Timeout)
		ids := map[string]bool{}
		for _, m := range got {
			ids[m.UUID] = true
		}
		require.Len(t, ids, len(msgs), "each group gets every message once")
	}
}

// testDeprovision: Deprovision removes a topic's topology with its
// messages, is idempotent, and a later Provision starts afresh.
func testDeprovision(t *testing.T, h Harness) {
	ctx := context.Background()
	b := newBroker(t, h)
	topic, group := Name("deprovision"), Name("g")
	require.NoError(t, b.Provision(ctx, topic, group))
	publishBatch(t, b, topic, []*message.Message{event("old", 1), event("old", 2)})
	require.NoError(t, b.Deprovision(ctx, topic, group))
	require.NoError(t, b.Deprovision(ctx, topic, group), "what is already gone is not an error")

	require.NoError(t, b.Provision(ctx, topic, group))
	fresh := event("new", 1)
	publishBatch(t, b, topic, []*message.Message{fresh})
	ch := Subscribe(t, b, topic, group)
	got := Receive(t, ch, 1, h.Timeout)
	require.Equal(t, fresh.UUID, got[0].UUID, "the deprovisioned topic's messages are gone")
	Quiet(t, ch, time.Second)
}

func testCompeting(t *testing.T, h Harness) {
	b := newBroker(t, h)
	topic, group := Name("compete"), Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	chs := []<-chan *message.Message{Subscribe(t, b, topic, group), Subscribe(t, b, topic, group)}

	const n = 200
	var msgs []*message.Message
	for i := range n {
		msgs = append(msgs, event(fmt.Sprintf("agg-%d", i), 1))
	}
	publishBatch(t, b, topic, msgs)

	var mu sync.Mutex
	counts := map[string]int{}
	total := 0
	ctx, cancel := context.WithTimeout(context.Background(), h.Timeout)
	defer cancel()
	var wg sync.WaitGroup
	for _, ch := range chs {
		wg.Go(func() {
			for {
				select {
				case m := <-ch:
					mu.Lock()
					counts[m.UUID]++
					total++
					done := total >= n
					mu.Unlock()
					m.Ack()
					if done {
						cancel()
					}
				case <-ctx.Done():
					return
				}
			}
		})
	}
	wg.Wait()
	require.Len(t, counts, n, "every message delivered")
	for id, c := range counts {
		require.Equal(t, 1, c, "message %s delivered to the group %d times", id, c)
	}
	for _, ch := range chs {
		Quiet(t, ch, time.Second)
	}
}

func testRedelivery(t *testing.T, h Harness) {
	b := newBroker(t, h)
	topic, group := Name("nack"), Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	ch := Subscribe(t, b, topic, group)
	m := event("agg-1", 1)
	publishBatch(t, b, topic, []*message.Message{m})

	select {
	case first := <-ch:
		require.Equal(t, m.UUID, first.UUID)
		first.Nack()
	case <-time.After(h.Timeout):
		require.FailNow(t, "timeout waiting for the first delivery")
	}
	again := Receive(t, ch, 1, h.Timeout)
	require.Equal(t, m.UUID, again[0].UUID, "a nacked message is delivered again")
	Quiet(t, ch, time.Second)
}

func testTooLarge(t *testing.T, h Harness) {
	b := newBroker(t, h)
	topic := Name("large")
	require.NoError(t, b.Provision(context.Background(), topic))
	big := message.NewMessage(Name("ev"), make([]byte, h.MaxMessageBytes+1))
	small := event("agg-1", 1)
	err := b.PublishBatch(context.Background(), []adapters.Outgoing{{Topic: topic, Msg: small}, {Topic: topic, Msg: big}})
	require.Error(t, err)
	require.True(t, adapters.IsPermanent(err), "too large is permanent: %v", err)
	be, ok := err.(*adapters.BatchError)
	require.True(t, ok, "a *BatchError: %T %v", err, err)
	require.Equal(t, 1, be.FirstUnconfirmed(), "the small message before it was confirmed")
	require.Contains(t, err.Error(), strconv.Itoa(h.MaxMessageBytes), "the error names the limit")
}

func testRestart(t *testing.T, h Harness) {
	b := newBroker(t, h)
	topic, group := Name("restart"), Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	ch := Subscribe(t, b, topic, group)

	var before []*message.Message
	for i := range 200 {
		before = append(before, event(fmt.Sprintf("agg-%d", i), 1))
	}
	publishBatch(t, b, topic, before)
	got := Receive(t, ch, 50, h.Timeout)

	h.RestartBroker(t)

	var after []*message.Message
	for i := range 200 {
		after = append(after, event(fmt.Sprintf("agg-%d", i), 2))
	}
	// Publishing while the client reconnects fails with retryable errors; the
	// relay retries, and so does this test.
	out := Outgoing(topic, after...)
	deadline := time.Now().Add(h.Timeout)
	for {
		err := b.PublishBatch(context.Background(), out)
		if err == nil {
			break
		}
		require.False(t, adapters.IsPermanent(err), "a restart is not a permanent error: %v", err)
		require.True(t, time.Now().Before(deadline), "publish never succeeded after the restart: %v", err)
		time.Sleep(200 * time.Millisecond)
	}

	want := map[string]bool{}
	for _, m := range append(before, after...) {
		want[m.UUID] = true
	}
	for _, m := range got {
		delete(want, m.UUID)
	}
	deadlineCh := time.After(h.Timeout)
	for len(want) > 0 {
		select {
		case m := <-ch:
			delete(want, m.UUID) // redeliveries of already-seen messages are allowed
			m.Ack()
		case <-deadlineCh:
			require.FailNow(t, "lost messages", "%d messages never arrived after the restart", len(want))
		}
	}
}

// unusualIDs are message ids a writer other than bus.Publish may have put in
// the outbox (bus.Publish refuses most of them): ids that differ only in
// white space, control characters or an encoding-like prefix must stay apart.
var unusualIDs = []string{
	"id A", "id\rA", "id\nA", "id\r\nA", "id\tA", " id", "id", "id ", "  id  ", "\tid",
	"=?utf-8?b?aWQ=?=", "=?utf-8?b?aWQ=?= ", "ид 🙂", "id\x01",
}

// unusualValues are header values NATS, Kafka and AMQP encode differently.
var unusualValues = []string{
	" lead", "trail ", "a\r\nb", "\t", "\n", "", "=?utf-8?b?Zm9v?=", "=?utf-8?b?bad?=", "ключ 🙂", "\x01\x1f\x7f", "a, b",
}

// unusualKeys are header names; each broker's Rules refuse some of them.
var unusualKeys = []string{
	"note", "my key", "a:b", "ключ", "Nats-Rollup", "x-death", "x-request-id", "CC", "_watermill_message_uuid",
}

// testUnusual publishes messages with unusual ids, header names and values:
// each arrives exactly as sent, or, when the broker's Rules refuse it,
// PublishBatch fails it permanently and the rest of the batch arrives.
func testUnusual(t *testing.T, h Harness) {
	b := newBroker(t, h)
	topic, group := Name("unusual"), Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	ch := Subscribe(t, b, topic, group)

	var batch []adapters.Outgoing
	add := func(id string, meta map[string]string) {
		m := message.NewMessage(id, []byte(`{"id":`+strconv.Quote(id)+`}`))
		for k, v := range meta {
			m.Metadata.Set(k, v)
		}
		batch = append(batch, adapters.Outgoing{Topic: topic, Msg: m})
	}
	for _, id := range unusualIDs {
		add(id, map[string]string{envelope.EventIDKey: id})
	}
	for i, v := range unusualValues {
		add(Name(fmt.Sprintf("value-%d", i)), map[string]string{"note": v})
	}
	for i, k := range unusualKeys {
		add(Name(fmt.Sprintf("key-%d", i)), map[string]string{k: "v"})
	}
	err := b.PublishBatch(context.Background(), batch)
	var be *adapters.BatchError
	if err != nil {
		require.ErrorAs(t, err, &be)
	}
	want := map[string]*message.Message{}
	for i, o := range batch {
		refused := b.Rules().CheckMessage(topic, o.Msg)
		var got error
		if be != nil {
			got = be.Errs[i]
		}
		if refused != nil {
			require.Error(t, got, "message %q: the Rules refuse it (%v), PublishBatch must not send it", o.Msg.UUID, refused)
			require.True(t, adapters.IsPermanent(got), "message %q: a refusal is permanent: %v", o.Msg.UUID, got)
			continue
		}
		require.NoError(t, got, "message %q", o.Msg.UUID)
		want[o.Msg.UUID] = o.Msg
	}
	for _, m := range Receive(t, ch, len(want), h.Timeout) {
		sent, ok := want[m.UUID]
		require.True(t, ok, "message id %q arrived, but no such id was sent or it arrived twice", m.UUID)
		delete(want, m.UUID)
		require.Equal(t, []byte(sent.Payload), []byte(m.Payload), "message %q", m.UUID)
		for k, v := range sent.Metadata {
			require.Equal(t, v, m.Metadata.Get(k), "message %q header %q", m.UUID, k)
		}
	}
	Quiet(t, ch, time.Second)
}
