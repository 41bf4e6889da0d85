package kafka_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

func event(aggregate string, version int) *message.Message {
	id := adaptertest.Name("ev")
	m := message.NewMessage(id, fmt.Appendf(nil, `{"aggregate":%q,"version":%d}`, aggregate, version))
	m.Metadata.Set(envelope.EventIDKey, id)
	m.Metadata.Set(envelope.AggregateIDKey, aggregate)
	return m
}

// events returns n events at version, one for each of the aggregates agg-0
// to agg-<n-1>, and adds their ids to ids.
func events(n, version int, ids map[string]bool) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("agg-%d", i), version)
		ids[msgs[i].UUID] = true
	}
	return msgs
}

// receiveIDs acks messages from ch until every id in want arrived; duplicates
// are allowed. It fails after timeout.
func receiveIDs(t *testing.T, ch <-chan *message.Message, want map[string]bool, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for len(want) > 0 {
		select {
		case m, ok := <-ch:
			require.True(t, ok, "subscription closed with %d messages missing", len(want))
			delete(want, m.UUID)
			m.Ack()
		case <-deadline:
			require.FailNow(t, "lost messages", "%d messages never arrived", len(want))
		}
	}
}

func TestOpenUnreachable(t *testing.T) {
	t.Parallel()
	// A closed port: connection refused, reported as soon as Sarama gives up.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closed := ln.Addr().String()
	require.NoError(t, ln.Close())

	// A port that accepts connections and never answers: only the timeout ends it.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = silent.Close() })
	go func() {
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Close() })
		}
	}()

	for _, addr := range []string{closed, silent.Addr().String()} {
		t.Run(addr, func(t *testing.T) {
			done := make(chan error, 1)
			go func() {
				b, err := kafka.Open(context.Background(), kafka.Config{Brokers: []string{addr}},
					adapters.Options{ConnectTimeout: time.Second})
				if b != nil {
					_ = b.Close()
				}
				done <- err
			}()
			select {
			case err := <-done:
				require.Error(t, err)
				assert.Contains(t, err.Error(), addr, "the error names the address")
			case <-time.After(60 * time.Second):
				require.FailNow(t, "Open hung on an unreachable broker")
			}
		})
	}
}

func TestInvalidConfig(t *testing.T) {
	t.Parallel()
	_, err := kafka.Open(context.Background(), kafka.Config{Brokers: []string{"nohost"}, MinInsyncReplicas: 4},
		adapters.Options{ConnectTimeout: time.Second})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "broker.kafka.brokers[0]: must be host:port")
	assert.Contains(t, err.Error(), "broker.kafka.min_insync_replicas: must be at most replication_factor (3); got 4")
}

// TestBrokerOutage stops the cluster while a Broker and a subscription are
// running: publishing fails with retryable errors while it is down, and once
// it is back (same ports, same data) the same Broker publishes again and the
// same subscription receives everything, before and after. Dev cluster only:
// a real cluster cannot be stopped by the test.
func TestBrokerOutage(t *testing.T) {
	t.Parallel()
	if realBrokers() != nil {
		t.Skip("KAFKA_BROKERS is set: the test cannot stop a real cluster")
	}
	env := newEnv(t)
	cfg := env.config()
	cfg.ProducerRetries = 10 // fail fast while the cluster is down: 1s, the shortest the producer allows
	cfg.ProducerRetryBackoff = 100 * time.Millisecond
	b := open(t, cfg)
	topic, group := adaptertest.Name("outage"), adaptertest.Name("g")
	require.NoError(t, b.Provision(context.Background(), topic, group))
	ch := adaptertest.Subscribe(t, b, topic, group)

	want := map[string]bool{}
	before := events(50, 1, want)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, before...)))

	env.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	err := b.PublishBatch(ctx, adaptertest.Outgoing(topic, event("agg-down", 1)))
	cancel()
	require.Error(t, err, "publishing to a stopped cluster cannot succeed")
	assert.False(t, adapters.IsPermanent(err), "an outage is retryable: %v", err)
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	assert.Equal(t, 1, be.Failed())

	env.start(t)
	after := events(50, 2, want)
	require.Eventually(t, func() bool {
		err := b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, after...))
		require.False(t, adapters.IsPermanent(err), "a restart is not permanent: %v", err)
		return err == nil
	}, 60*time.Second, 200*time.Millisecond, "publishing never recovered")
	receiveIDs(t, ch, want, 60*time.Second)
}

// TestClusterReplaced replaces the cluster with an empty one on the same
// ports (as after losing a dev cluster's memory, or pointing DNS at a new
// cluster): the topic is gone, and the same Broker creates it again and
// publishes. Dev cluster only.
func TestClusterReplaced(t *testing.T) {
	t.Parallel()
	if realBrokers() != nil {
		t.Skip("KAFKA_BROKERS is set: the test cannot replace a real cluster")
	}
	env := newEnv(t)
	b := open(t, env.config())
	topic := adaptertest.Name("replaced")
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, event("a", 1))))

	addrs := env.dev.Addrs()
	env.stop()
	var fresh *kafkadev.Cluster
	require.Eventually(t, func() bool {
		var err error
		fresh, err = kafkadev.Start(kafkadev.Options{Addrs: addrs})
		return err == nil
	}, 30*time.Second, 100*time.Millisecond)
	t.Cleanup(fresh.Close)

	require.Eventually(t, func() bool {
		err := b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, event("a", 2)))
		require.False(t, adapters.IsPermanent(err), "%v", err)
		return err == nil
	}, 60*time.Second, 200*time.Millisecond, "publishing never recovered on the new cluster")
}

// TestTooLargeForTopic: a topic whose max.message.bytes is below
// broker.kafka.max_message_bytes refuses a whole record batch when one
// message in it is too large; the adapter resends the others alone, so only
// the large one fails, permanently, with the topic's limit in the error.
func TestTooLargeForTopic(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	cfg := env.config()
	b := open(t, cfg)
	topic := adaptertest.Name("small")
	createTopic(t, env, topic, int32(cfg.WithDefaults().Partitions), map[string]string{"max.message.bytes": "4096"})

	big := event("same-key", 2)
	noise := make([]byte, 4500) // random, so compression cannot shrink it under the limit
	_, _ = rand.Read(noise)
	big.Payload = []byte(`"` + base64.StdEncoding.EncodeToString(noise) + `"`)
	msgs := []*message.Message{event("same-key", 1), big, event("same-key", 3)}
	err := b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...))
	var be *adapters.BatchError
	require.ErrorAs(t, err, &be)
	assert.NoError(t, be.Errs[0])
	assert.NoError(t, be.Errs[2])
	require.Error(t, be.Errs[1])
	assert.True(t, adapters.IsPermanent(be.Errs[1]))
	assert.ErrorIs(t, be.Errs[1], adapters.ErrMessageTooLarge)
	assert.Contains(t, be.Errs[1].Error(), "4096")

	// Provision names the conflict before any publish would hit it.
	err = b.Provision(context.Background(), topic)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "max.message.bytes is 4096, less than broker.kafka.max_message_bytes 1048576")
}

func TestProvisionConflicts(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	b := open(t, env.config())

	fresh := adaptertest.Name("prov")
	require.NoError(t, b.Provision(context.Background(), fresh, "g1", "g2"))
	require.NoError(t, b.Provision(context.Background(), fresh, "g1"), "Provision is idempotent")

	other := adaptertest.Name("prov-2p")
	createTopic(t, env, other, 2, map[string]string{"min.insync.replicas": "1"})
	err := b.Provision(context.Background(), other)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "has 2 partitions, broker.kafka.partitions is 6")
	if env.rf > 1 {
		assert.Contains(t, err.Error(), fmt.Sprintf("min.insync.replicas is 1, less than broker.kafka.min_insync_replicas %d", min(2, env.rf)))
	}

	require.Error(t, b.Provision(context.Background(), "bad topic name"))
	require.Error(t, b.Provision(context.Background(), fresh, "bad group!"))
}

// TestNewGroupReadsFromTheStart: a consumer group that joins after events
// were published still gets them (Sarama's default would start it at the
// newest offset and skip them).
func TestNewGroupReadsFromTheStart(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	b := open(t, env.config())
	topic := adaptertest.Name("late")
	want := map[string]bool{}
	msgs := events(20, 1, want)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)))
	receiveIDs(t, adaptertest.Subscribe(t, b, topic, adaptertest.Name("late-group")), want, 60*time.Second)
}

// TestOnlyAckedIsCommitted: a subscriber that closes with a message
// delivered but not acked leaves it uncommitted; the group's next consumer
// starts with that message, after the acked ones, and headers unknown to
// millrace survive the trip.
func TestOnlyAckedIsCommitted(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	b := open(t, env.config())
	topic, group := adaptertest.Name("commit"), adaptertest.Name("g")
	var msgs []*message.Message
	for v := 1; v <= 5; v++ {
		m := event("one-aggregate", v)
		m.Metadata.Set("x-custom-header", fmt.Sprintf("value-%d", v))
		msgs = append(msgs, m)
	}
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)))

	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	for i := range 3 {
		m := <-ch
		require.Equal(t, msgs[i].UUID, m.UUID, "one aggregate is delivered in order")
		require.Equal(t, fmt.Sprintf("value-%d", i+1), m.Metadata.Get("x-custom-header"))
		if i < 2 {
			m.Ack()
		}
	}
	require.NoError(t, sub.Close())

	ch2 := adaptertest.Subscribe(t, b, topic, group)
	select {
	case m := <-ch2:
		assert.Equal(t, msgs[2].UUID, m.UUID, "the next consumer starts at the unacked message")
		m.Ack()
	case <-time.After(60 * time.Second):
		require.FailNow(t, "the unacked message was never redelivered")
	}
}

// createTopic creates a topic directly with Sarama's admin client, bypassing
// the adapter's provisioning.
func createTopic(t *testing.T, env *testEnv, topic string, partitions int32, configs map[string]string) {
	t.Helper()
	conf := sarama.NewConfig()
	conf.Version = sarama.V2_8_0_0
	admin, err := sarama.NewClusterAdmin(env.brokers, conf)
	require.NoError(t, err)
	defer func() { _ = admin.Close() }()
	entries := map[string]*string{}
	for k, v := range configs {
		entries[k] = &v
	}
	err = admin.CreateTopic(topic, &sarama.TopicDetail{
		NumPartitions: partitions, ReplicationFactor: int16(env.rf), ConfigEntries: entries,
	}, false)
	if !errors.Is(err, sarama.ErrTopicAlreadyExists) {
		require.NoError(t, err)
	}
}

// TestDevClusterShared: Brokers opened in one process on the same
// dev_cluster config share one cluster, which stops with the last Close; an
// address already in use is a clear error.
func TestDevClusterShared(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()

	_, err = kafka.Open(context.Background(), kafka.Config{Brokers: []string{addr}, DevCluster: true},
		adapters.Options{ConnectTimeout: 5 * time.Second})
	require.Error(t, err, "the address is taken")
	assert.Contains(t, err.Error(), addr)
	assert.Contains(t, err.Error(), "dev_cluster: false")
	require.NoError(t, ln.Close())

	cfg := kafka.Config{Brokers: []string{addr}, DevCluster: true, HeartbeatInterval: 500 * time.Millisecond}
	opts := adapters.Options{ConnectTimeout: 30 * time.Second}
	a, err := kafka.Open(context.Background(), cfg, opts)
	require.NoError(t, err)
	b, err := kafka.Open(context.Background(), cfg, opts)
	require.NoError(t, err)

	topic := adaptertest.Name("shared")
	m := event("a", 1)
	require.NoError(t, a.PublishBatch(context.Background(), adaptertest.Outgoing(topic, m)))
	require.NoError(t, a.Close())
	receiveIDs(t, adaptertest.Subscribe(t, b, topic, adaptertest.Name("g")), map[string]bool{m.UUID: true}, 60*time.Second)
	require.NoError(t, b.Close())

	require.Eventually(t, func() bool {
		l, err := net.Listen("tcp", addr)
		if err == nil {
			_ = l.Close()
		}
		return err == nil
	}, 30*time.Second, 100*time.Millisecond, "the dev cluster stops with the last Broker")
}

// TestCloseDuringPublish: Close while publishes are under way returns, and
// every message it cut short fails with ErrClosed (the relay sends it
// again); nothing hangs.
func TestCloseDuringPublish(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	b, err := kafka.Open(context.Background(), env.config(), adapters.Options{ConnectTimeout: 30 * time.Second})
	require.NoError(t, err)
	topic := adaptertest.Name("closing")
	require.NoError(t, b.Provision(context.Background(), topic))
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, event("agg-0", 1))))

	errs := make(chan error, 4)
	for g := range 4 {
		go func() {
			for v := 1; ; v++ {
				var msgs []*message.Message
				for i := range 50 {
					msgs = append(msgs, event(fmt.Sprintf("agg-%d-%d", g, i), v))
				}
				if err := b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	require.NoError(t, b.Close())
	for range 4 {
		err := <-errs
		var be *adapters.BatchError
		require.ErrorAs(t, err, &be)
		for _, e := range be.Errs {
			if e != nil {
				require.ErrorIs(t, e, adapters.ErrClosed)
			}
		}
	}
}

// TestHoldOutlastsRebalance: a member of a group holds a delivered message
// (as the circuit breaker does during an outage, until the message's context
// ends) while another member joins, for longer than the rebalance timeout.
// The held message's context ends with its session, so the member nacks it
// and rejoins in time, and every message is processed.
func TestHoldOutlastsRebalance(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	cfg := env.config()
	cfg.Partitions = 2
	cfg.SessionTimeout = 6 * time.Second // the least kfake (and Kafka) accept
	cfg.RebalanceTimeout = 2 * time.Second
	cfg.JoinWait = 2 * time.Second
	b := open(t, cfg)
	topic, group := adaptertest.Name("hold"), adaptertest.Name("g")

	const n = 40
	var msgs []*message.Message
	for i := range n {
		msgs = append(msgs, event(fmt.Sprintf("agg-%d", i%8), i))
	}
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, msgs...)))

	var mu sync.Mutex
	processed := map[string]bool{}
	consume := func(ch <-chan *message.Message, hold func(*message.Message) bool) {
		for m := range ch {
			if hold != nil && !hold(m) {
				m.Nack()
				continue
			}
			mu.Lock()
			processed[m.UUID] = true
			mu.Unlock()
			m.Ack()
		}
	}

	held := make(chan struct{})
	endHold := make(chan struct{})
	released := make(chan error, 1)
	var once sync.Once
	// The first message is held until its context ends (then nacked, as
	// the breaker's shutdown is) or the hold ends (then processed).
	hold := func(m *message.Message) bool {
		first := false
		once.Do(func() { first = true })
		if !first {
			return true
		}
		close(held)
		select {
		case <-m.Context().Done():
			released <- context.Cause(m.Context())
			return false
		case <-endHold:
			return true
		}
	}
	go consume(adaptertest.Subscribe(t, b, topic, group), hold)

	select {
	case <-held:
	case <-time.After(30 * time.Second):
		require.FailNow(t, "no message was delivered")
	}
	go consume(adaptertest.Subscribe(t, b, topic, group), nil)
	// Hold well past the rebalance timeout the join starts.
	time.Sleep(3 * cfg.RebalanceTimeout)
	close(endHold)
	select {
	case cause := <-released:
		require.ErrorIs(t, cause, kafka.ErrRebalanced, "the held message's context ends with its session")
	default:
		require.FailNow(t, "the held message's context did not end when the group rebalanced")
	}

	testkit.Eventually(t, 60*time.Second, "every message is processed after the hold", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(processed) == n
	})
}
