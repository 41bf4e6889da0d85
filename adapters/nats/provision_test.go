package nats

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// Provision makes the configured stream and consumers, and again is a no-op.
func TestProvisionCreatesConfiguredTopology(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, func(c *Config) {
			c.Stream.MaxAge = 48 * time.Hour
			c.Stream.DuplicateWindow = 5 * time.Minute
			c.Stream.MaxMsgSize = 512 * 1024
			c.Stream.MaxBytes = 1 << 30
			c.Consumer.AckWait = 45 * time.Second
			c.Consumer.MaxDeliver = 20
			c.Consumer.MaxAckPending = 7
		})
		topic := adaptertest.Name("orders.events")
		groups := []string{adaptertest.Name("billing.v2"), adaptertest.Name("shipping")}
		trackStream(url, StreamName(topic))
		for range 2 {
			require.NoError(t, b.Provision(context.Background(), topic, groups...))
			b.forgetStream(topic) // check the server again, not the cache
		}

		s, err := b.js.Stream(context.Background(), StreamName(topic))
		require.NoError(t, err)
		sc := s.CachedInfo().Config
		require.Equal(t, strings.ReplaceAll(strings.ReplaceAll(topic, "-", "--"), ".", "_"), sc.Name)
		require.Equal(t, []string{topic}, sc.Subjects)
		require.Equal(t, jetstream.FileStorage, sc.Storage)
		require.Equal(t, jetstream.LimitsPolicy, sc.Retention)
		require.Equal(t, jetstream.DiscardNew, sc.Discard)
		require.Equal(t, 1, sc.Replicas)
		require.Equal(t, 48*time.Hour, sc.MaxAge)
		require.Equal(t, 5*time.Minute, sc.Duplicates)
		require.EqualValues(t, 512*1024, sc.MaxMsgSize)
		require.EqualValues(t, 1<<30, sc.MaxBytes)

		for _, g := range groups {
			c := consumerInfo(t, b, topic, g).Config
			require.Equal(t, ConsumerName(g), c.Durable)
			require.Equal(t, ConsumerName(g), c.DeliverGroup)
			require.NotEmpty(t, c.DeliverSubject)
			require.Equal(t, jetstream.AckExplicitPolicy, c.AckPolicy)
			require.Equal(t, jetstream.DeliverAllPolicy, c.DeliverPolicy)
			require.Equal(t, 45*time.Second, c.AckWait)
			require.Equal(t, 20, c.MaxDeliver)
			require.Equal(t, 7, c.MaxAckPending)
		}
	})
}

// An existing stream or consumer with other settings is reported with each
// difference, and left as it is.
func TestProvisionReportsConflicts(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, nil)
		ctx := context.Background()

		topic := adaptertest.Name("conflict")
		other := b.streamConfig(topic)
		other.MaxAge, other.Duplicates, other.Storage = time.Hour, time.Minute, jetstream.MemoryStorage
		_, err := b.js.CreateStream(ctx, other)
		require.NoError(t, err)
		trackStream(url, other.Name)
		err = b.Provision(ctx, topic)
		require.ErrorIs(t, err, adapters.ErrTopologyConflict)
		for _, want := range []string{
			"stream \"" + StreamName(topic) + "\"", "topic \"" + topic + "\"",
			"max_age is 1h0m0s on the server, 168h0m0s wanted (broker.nats.stream.max_age)",
			"duplicate_window is 1m0s on the server, 2m0s wanted",
			"storage is Memory on the server, File wanted",
		} {
			require.ErrorContains(t, err, want)
		}
		s, err := b.js.Stream(ctx, other.Name)
		require.NoError(t, err)
		require.Equal(t, time.Hour, s.CachedInfo().Config.MaxAge, "left as it was")

		// A consumer of the group with another ack_wait.
		topic2, group := adaptertest.Name("conflict"), adaptertest.Name("g")
		require.NoError(t, b.Provision(ctx, topic2))
		cc := b.consumerConfig(topic2, group)
		cc.AckWait = 5 * time.Second
		_, err = b.js.CreatePushConsumer(ctx, StreamName(topic2), cc)
		require.NoError(t, err)
		err = b.Provision(ctx, topic2, group)
		require.ErrorIs(t, err, adapters.ErrTopologyConflict)
		require.ErrorContains(t, err, "ack_wait is 5s on the server, 1m0s wanted (broker.nats.consumer.ack_wait)")

		// A pull consumer under the group's name.
		group2 := adaptertest.Name("g")
		_, err = b.js.CreateConsumer(ctx, StreamName(topic2), jetstream.ConsumerConfig{Durable: ConsumerName(group2), AckPolicy: jetstream.AckExplicitPolicy})
		require.NoError(t, err)
		err = b.Provision(ctx, topic2, group2)
		require.ErrorIs(t, err, adapters.ErrTopologyConflict)
		require.ErrorContains(t, err, "pull consumer")

		// Another stream already captures the topic's subject.
		topic3, otherName := adaptertest.Name("captured"), adaptertest.Name("OTHER")
		_, err = b.js.CreateStream(ctx, jetstream.StreamConfig{Name: otherName, Subjects: []string{topic3}})
		require.NoError(t, err)
		trackStream(url, otherName)
		err = b.Provision(ctx, topic3)
		require.ErrorIs(t, err, adapters.ErrTopologyConflict)
		require.ErrorContains(t, err, "another stream already captures subject")
	})
}

// The trap behind verifying what the server echoes: nats-server before 2.11
// accepts a stream config with fields it does not know (here allow_msg_ttl)
// and silently drops them; 2.11 and later keep them. millrace sets only
// fields 2.9 knows and compares the server's answer with what it asked.
func TestServerDropsUnknownStreamFields(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		b := openBroker(t, url, nil)
		cfg := b.streamConfig(adaptertest.Name("ttl"))
		cfg.AllowMsgTTL = true
		s, err := b.js.CreateStream(context.Background(), cfg)
		require.NoError(t, err, "no server refuses it")
		trackStream(url, cfg.Name)
		version := b.nc.ConnectedServerVersion()
		if serverAtLeast(version, 2, 11) {
			require.True(t, s.CachedInfo().Config.AllowMsgTTL, "server %s keeps the field", version)
		} else {
			require.False(t, s.CachedInfo().Config.AllowMsgTTL, "server %s drops the field without an error", version)
		}
	})
}

func serverAtLeast(version string, major, minor int) bool {
	var ma, mi int
	_, _ = fmt.Sscanf(version, "%d.%d", &ma, &mi)
	return ma > major || (ma == major && mi >= minor)
}

// A created stream the server changed is reported as not applied.
func TestDiffStreamReportsDroppedSettings(t *testing.T) {
	t.Parallel()
	b := &Broker{cfg: Config{URL: "nats://x"}.WithDefaults()}
	want := b.streamConfig("orders.events")
	got := want
	got.Duplicates = 0
	got.MaxMsgSize = 0
	d := diffStream(want, got)
	require.Equal(t, []string{
		"duplicate_window is 0s on the server, 2m0s wanted (broker.nats.stream.duplicate_window)",
		"max_msg_size is 0 on the server, -1 wanted (broker.nats.stream.max_msg_size (0 in config is -1 on the server))",
	}, d)
	require.Empty(t, diffStream(want, want))

	wc := b.consumerConfig("orders.events", "billing")
	gc := wc
	require.Empty(t, diffConsumer(wc, gc, "orders.events", false))
	gc.FilterSubject = "orders.events"
	require.Empty(t, diffConsumer(wc, gc, "orders.events", false), "a filter equal to the only subject is no filter")
	gc.FilterSubject, gc.DeliverSubject = "orders.other", ""
	require.Len(t, diffConsumer(wc, gc, "orders.events", false), 2)

	// An ordered group's ordered subscriber sets its max_ack_pending and start.
	gc = wc
	gc.MaxAckPending, gc.DeliverPolicy, gc.OptStartSeq = 64, jetstream.DeliverByStartSequencePolicy, 42
	require.Empty(t, diffConsumer(wc, gc, "orders.events", true))
	d = diffConsumer(wc, gc, "orders.events", false)
	require.Len(t, d, 1)
	require.Contains(t, d[0], "max_ack_pending is 64 on the server")
	// A group keeps the start it was created with, whatever consumer.start says now.
	gc = wc
	gc.DeliverPolicy = jetstream.DeliverNewPolicy
	require.Empty(t, diffConsumer(wc, gc, "orders.events", false))
	gc.DeliverPolicy, gc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, 42
	require.Empty(t, diffConsumer(wc, gc, "orders.events", false))
}

// Two processes creating one new group with consumer.start new at once ask
// for different start sequences when a message lands between their reads
// of the stream; the second create must find the group the first made, not
// fail (the server refuses it as a deliver-policy update).
func TestConcurrentCreateOfOneNewGroup(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, url string) {
		ctx := context.Background()
		first, second := openBroker(t, url, nil), openBroker(t, url, nil)
		topic, group := adaptertest.Name("race.events"), adaptertest.Name("race-group")
		trackStream(url, StreamName(topic))
		require.NoError(t, first.Provision(ctx, topic))
		want := first.consumerConfig(topic, group)
		_, created, err := first.createConsumer(ctx, StreamName(topic), want, adapters.StartNew)
		require.NoError(t, err)
		require.True(t, created)
		_, err = first.js.Publish(ctx, topic, []byte("lands between the two reads"))
		require.NoError(t, err)

		c, created, err := second.createConsumer(ctx, StreamName(topic), second.consumerConfig(topic, group), adapters.StartNew)
		require.NoError(t, err, "the second process finds the group the first created")
		require.False(t, created)
		require.Equal(t, ConsumerName(group), c.CachedInfo().Config.Durable)
		require.NoError(t, second.ProvisionGroup(ctx, topic, adapters.GroupSpec{Name: group, Start: adapters.StartNew}))
	})
}
