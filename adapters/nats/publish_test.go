package nats

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
)

// eachServer runs test on the servers most behaviour tests run against: the
// in-process nats-server (v2.15) and the shared one at NATS_URL (here
// nats-server 2.9).
func eachServer(t *testing.T, test func(t *testing.T, url string)) {
	t.Run("Embedded", func(t *testing.T) {
		t.Parallel()
		test(t, servers.StartEmbeddedNATS(t).URL)
	})
	t.Run("Shared", func(t *testing.T) {
		t.Parallel()
		test(t, sharedURL())
	})
}

func newMsg(id string) *message.Message {
	m := message.NewMessage(id, []byte(`{"n":1}`))
	m.Metadata.Set("event-id", id)
	return m
}

func streamMsgs(t *testing.T, b *Broker, topic string) uint64 {
	t.Helper()
	s, err := b.js.Stream(context.Background(), StreamName(topic))
	require.NoError(t, err)
	return s.CachedInfo().State.Msgs
}

// The relay re-publishes a batch it has no confirm for; Nats-Msg-Id = event
// id lets the server's duplicate window store each event once.
func TestDuplicateWindowDropsRepublish(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, nil)
		topic := adaptertest.Name("orders.dedup")
		var msgs []*message.Message
		for i := range 20 {
			msgs = append(msgs, newMsg(adaptertest.Name("ev"+strconv.Itoa(i))))
		}
		require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)))
		require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)), "a duplicate is confirmed, not an error")
		require.EqualValues(t, 20, streamMsgs(t, b, topic), "the second publish of each event was dropped")

		// The one-at-a-time publisher sets the same header.
		pub := b.Publisher()
		require.NoError(t, pub.Publish(topic, msgs[0], msgs[1]))
		one := newMsg(adaptertest.Name("ev-single"))
		require.NoError(t, pub.Publish(topic, one))
		require.NoError(t, pub.Publish(topic, one))
		require.EqualValues(t, 21, streamMsgs(t, b, topic))
	})
}

// A stream that conflicts with the config fails its topic's messages
// permanently (the relay quarantines them; an operator fixes the stream and
// replays them), and the rest of the batch is stored.
func TestPublishBatchFailsAConflictingTopicAlone(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, nil)
		good, bad := adaptertest.Name("stop.good"), adaptertest.Name("stop.bad")
		// bad's stream exists with another max_age: provisioning it fails.
		other := b.streamConfig(bad)
		other.MaxAge = time.Hour
		_, err := b.js.CreateStream(context.Background(), other)
		require.NoError(t, err)
		trackStream(url, other.Name)

		batch := append(adaptertest.Outgoing(good, newMsg(adaptertest.Name("a")), newMsg(adaptertest.Name("b"))),
			adapters.Outgoing{Topic: bad, Msg: newMsg(adaptertest.Name("c"))})
		batch = append(batch, adaptertest.Outgoing(good, newMsg(adaptertest.Name("d")), newMsg(adaptertest.Name("e")))...)
		err = b.PublishBatch(context.Background(), batch)
		var be *adapters.BatchError
		require.ErrorAs(t, err, &be)
		require.Equal(t, 2, be.FirstUnconfirmed())
		require.Equal(t, 1, be.Failed())
		require.ErrorIs(t, be.Errs[2], adapters.ErrTopologyConflict)
		require.Contains(t, be.Errs[2].Error(), "max_age is 1h0m0s on the server, 168h0m0s wanted")
		require.True(t, adapters.IsPermanent(be.Errs[2]), "no retry fixes a conflict: the relay quarantines the message")
		require.EqualValues(t, 4, streamMsgs(t, b, good), "the other topic's messages were stored")
	})
}

// A retryable failure stops the rest of the batch: the relay retries from
// the first unconfirmed message. Messages already in flight when the
// failure is reported may still be confirmed (see the README on ordering);
// none is sent after it.
func TestPublishBatchStopsAtFirstRetryableFailure(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		// Streams of at most 1000 bytes that refuse new messages when full:
		// a full stream is retryable (messages age out of it).
		b := openBroker(t, url, func(c *Config) { c.Stream.MaxBytes = 1000 })
		good, full := adaptertest.Name("stop.good"), adaptertest.Name("stop.full")
		filler := message.NewMessage(adaptertest.Name("filler"), make([]byte, 800))
		require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(full, filler)))
		trackStream(url, StreamName(full))

		over := message.NewMessage(adaptertest.Name("over"), make([]byte, 400))
		batch := append(adaptertest.Outgoing(good, newMsg(adaptertest.Name("a"))), adapters.Outgoing{Topic: full, Msg: over})
		batch = append(batch, adaptertest.Outgoing(good, newMsg(adaptertest.Name("c")), newMsg(adaptertest.Name("d")))...)
		err := b.PublishBatch(context.Background(), batch)
		trackStream(url, StreamName(good))
		var be *adapters.BatchError
		require.ErrorAs(t, err, &be)
		require.Equal(t, 1, be.FirstUnconfirmed())
		require.False(t, adapters.IsPermanent(be.Errs[1]), "a full stream is retryable: %v", be.Errs[1])
		require.ErrorContains(t, be.Errs[1], "maximum bytes exceeded")
		stored := 1
		for i := 2; i < 4; i++ {
			if be.Errs[i] == nil {
				stored++ // in flight before the failure was reported
				continue
			}
			require.ErrorContains(t, be.Errs[i], "not sent because an earlier message of the batch failed")
		}
		require.EqualValues(t, stored, streamMsgs(t, b, good), "what was not confirmed was not stored")
	})
}

// A message over the limit fails alone and permanently; the messages around
// it are stored. The embedded server shows the stream's max_msg_size (checked
// by the server), the shared one the server's max_payload (checked by the
// client before sending).
func TestMessageTooLargeFailsAlone(t *testing.T) {
	t.Parallel()
	t.Run("StreamMaxMsgSize", func(t *testing.T) {
		t.Parallel()
		b := openBroker(t, servers.StartEmbeddedNATS(t).URL, func(c *Config) { c.Stream.MaxMsgSize = 4096 })
		checkTooLarge(t, b, 4096, "the stream's max_msg_size limit of 4096 bytes")
	})
	t.Run("ServerMaxPayload", func(t *testing.T) {
		t.Parallel()
		b := openBroker(t, sharedURL(), nil)
		limit := int(b.nc.MaxPayload())
		checkTooLarge(t, b, limit, fmt.Sprintf("the server's max_payload limit of %d bytes", limit))
	})
}

func checkTooLarge(t *testing.T, b *Broker, limit int, wantText string) {
	topic := adaptertest.Name("large")
	big := message.NewMessage(adaptertest.Name("big"), make([]byte, limit+1))
	err := b.PublishBatch(context.Background(), []adapters.Outgoing{
		{Topic: topic, Msg: newMsg(adaptertest.Name("a"))},
		{Topic: topic, Msg: big},
		{Topic: topic, Msg: newMsg(adaptertest.Name("b"))},
	})
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	require.NoError(t, be.Errs[0])
	require.NoError(t, be.Errs[2], "the message after the large one is still sent")
	require.ErrorIs(t, be.Errs[1], adapters.ErrMessageTooLarge)
	require.True(t, adapters.IsPermanent(be.Errs[1]))
	require.ErrorContains(t, be.Errs[1], wantText)
	require.EqualValues(t, 2, streamMsgs(t, b, topic))

	err = b.Publisher().Publish(topic, message.NewMessage(adaptertest.Name("big"), make([]byte, limit+1)))
	require.ErrorIs(t, err, adapters.ErrMessageTooLarge, "the one-at-a-time publisher says the same")
	require.True(t, adapters.IsPermanent(err))
	require.ErrorContains(t, err, wantText)
}

func TestPublishInvalidTopic(t *testing.T) {
	t.Parallel()
	b := openBroker(t, servers.StartEmbeddedNATS(t).URL, nil)
	for _, topic := range []string{"orders..events", "orders.", "orders events", "orders.*", ""} {
		err := b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, newMsg("x")))
		require.Error(t, err, topic)
		require.True(t, adapters.IsPermanent(err), "%q: %v", topic, err)
		require.ErrorContains(t, err, fmt.Sprintf("topic %q", topic))
		require.True(t, adapters.IsPermanent(b.Publisher().Publish(topic, newMsg("x"))))
		require.ErrorContains(t, b.Provision(context.Background(), topic), fmt.Sprintf("topic %q", topic))
	}
}

// PublishBatch keeps at most publish.max_pending messages unconfirmed: a
// subject that swallows messages without confirming them receives exactly
// max_pending before the batch stops.
func TestPublishBatchBoundsInFlight(t *testing.T) {
	t.Parallel()
	const maxPending = 3
	b := openBroker(t, servers.StartEmbeddedNATS(t).URL, func(c *Config) {
		c.Publish.MaxPending = maxPending
		c.Publish.Timeout = 500 * time.Millisecond
	})
	topic := adaptertest.Name("blackhole")
	// No stream: a plain subscriber takes the messages and never confirms.
	b.mu.Lock()
	b.streams[topic] = true
	b.mu.Unlock()
	sink, err := nats.Connect(b.URL())
	require.NoError(t, err)
	defer sink.Close()
	got := make(chan *nats.Msg, 100)
	_, err = sink.ChanSubscribe(topic, got)
	require.NoError(t, err)
	require.NoError(t, sink.Flush())

	var msgs []*message.Message
	for i := range 10 {
		msgs = append(msgs, newMsg(fmt.Sprintf("m%d", i)))
	}
	err = b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...))
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	require.Equal(t, 0, be.FirstUnconfirmed())
	for i, e := range be.Errs {
		require.Error(t, e, "message %d", i)
		require.False(t, adapters.IsPermanent(e), "message %d: %v", i, e)
	}
	require.Len(t, got, maxPending, "only max_pending messages went out unconfirmed")
	for i := 0; i < maxPending; i++ {
		m := <-got
		require.Equal(t, fmt.Sprintf("m%d", i), m.Header.Get(nats.MsgIdHdr), "sent in slice order with Nats-Msg-Id")
	}
}

// Metadata travels as headers, including values NATS headers would alter
// and keys millrace does not know.
func TestMetadataRoundTrip(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, nil)
		topic, group := adaptertest.Name("meta"), adaptertest.Name("g")
		values := map[string]string{
			"plain":            "v",
			"X-Unknown-To-Us":  "anything",
			"json":             "{\n  \"a\": 1\n}",
			"padded":           "  both ends \t",
			"crlf":             "a\r\nb",
			"looks-encoded":    "=?utf-8?b?aGk=?=",
			"empty":            "",
			"unicode":          "zażółć ✓",
			"aggregate-id":     "order-7",
			"Mixed-Case-Key":   "kept as is",
			"traceparent":      "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
			"content-type":     "application/json",
			"aggregate-versio": "1",
		}
		m := message.NewMessage(adaptertest.Name("ev"), []byte("payload"))
		for k, v := range values {
			m.Metadata.Set(k, v)
		}
		require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, m)))
		got := adaptertest.Receive(t, adaptertest.Subscribe(t, b, topic, group), 1, time.Minute)[0]
		require.Equal(t, m.UUID, got.UUID)
		require.Equal(t, "payload", string(got.Payload))
		require.Equal(t, message.Metadata(values), got.Metadata)

		for _, key := range []string{"Nats-Rollup", "nats-msg-id", "bad key", "a:b", "_watermill_message_uuid"} {
			bad := newMsg(adaptertest.Name("bad"))
			bad.Metadata.Set(key, "sub")
			err := b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, bad))
			require.True(t, adapters.IsPermanent(err), "%q: %v", key, err)
			require.ErrorContains(t, err, fmt.Sprintf("%q", key))
		}
	})
}

// A header with several values (only a foreign publisher sends one) is
// delivered, values joined, instead of failing to unmarshal and coming back
// forever.
func TestMultiValueHeaderIsDelivered(t *testing.T) {
	t.Parallel()
	b := openBroker(t, servers.StartEmbeddedNATS(t).URL, nil)
	topic, group := provisioned(t, b, "multi")
	nm := nats.NewMsg(topic)
	nm.Header.Add("tag", "a")
	nm.Header.Add("tag", "b")
	nm.Header.Set("_watermill_message_uuid", "foreign-1")
	nm.Data = []byte("x")
	_, err := b.js.PublishMsg(context.Background(), nm)
	require.NoError(t, err)
	got := adaptertest.Receive(t, adaptertest.Subscribe(t, b, topic, group), 1, time.Minute)[0]
	require.Equal(t, "foreign-1", got.UUID)
	require.Equal(t, "a, b", got.Metadata.Get("tag"))
}
