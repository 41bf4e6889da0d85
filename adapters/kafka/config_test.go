package kafka_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/bus"
)

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c := kafka.Config{Brokers: []string{"127.0.0.1:9092"}}.WithDefaults()
	assert.Empty(t, c.Validate("broker.kafka"))
	assert.Equal(t, "2.8.0", c.Version)
	assert.Equal(t, 6, c.Partitions)
	assert.Equal(t, 3, c.ReplicationFactor)
	assert.Equal(t, 2, c.MinInsyncReplicas)
	assert.True(t, *c.AutoProvision)
	assert.Equal(t, time.Second, *c.CommitInterval)
	assert.Equal(t, "snappy", c.Compression)

	one := kafka.Config{Brokers: []string{"k:9092"}, ReplicationFactor: 1}.WithDefaults()
	assert.Equal(t, 1, one.MinInsyncReplicas, "min.insync.replicas follows a replication factor of 1")
	zero := time.Duration(0)
	sync := kafka.Config{Brokers: []string{"k:9092"}, CommitInterval: &zero}.WithDefaults()
	assert.Equal(t, time.Duration(0), *sync.CommitInterval, "0 means commit after every ack")
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	c := kafka.Config{
		Brokers:              []string{"", "host-without-port", "10.0.0.1:9092"},
		DevCluster:           true,
		Version:              "0.10.2.0",
		ReplicationFactor:    1,
		MinInsyncReplicas:    2,
		MaxMessageBytes:      10,
		Compression:          "brotli",
		HeartbeatInterval:    20 * time.Second,
		RebalanceTimeout:     30 * time.Second,
		ProducerRetries:      5,
		ProducerRetryBackoff: 100 * time.Millisecond,
	}.WithDefaults()
	var got []string
	for _, err := range c.Validate("broker.kafka") {
		got = append(got, err.Error())
	}
	all := strings.Join(got, "\n")
	for _, want := range []string{
		"broker.kafka.brokers[0]: must not be empty",
		`broker.kafka.brokers[1]: must be host:port; got "host-without-port"`,
		`broker.kafka.brokers[2]: with dev_cluster: true the in-process cluster listens on 127.0.0.1 only; got "10.0.0.1:9092"`,
		`broker.kafka.version: must be at least 0.11.0`,
		"broker.kafka.min_insync_replicas: must be at most replication_factor (1); got 2",
		"broker.kafka.max_message_bytes: must be from 1024 to",
		`broker.kafka.compression: must be one of none, gzip, snappy, lz4, zstd; got "brotli"`,
		"broker.kafka.heartbeat_interval: must be less than session_timeout (10s); got 20s",
		"broker.kafka.rebalance_timeout: must be at least twice heartbeat_interval (20s); got 30s",
		"broker.kafka.producer_retries: times producer_retry_backoff (100ms) must be at least 1s, the shortest delivery timeout of the producer; got 5 x 100ms",
	} {
		assert.Contains(t, all, want)
	}
	assert.Empty(t, kafka.Config{}.WithDefaults().Validate("broker.kafka"), "the defaults are valid: a local broker")
	assert.Equal(t, []string{kafka.DefaultBroker}, kafka.Config{}.WithDefaults().Brokers)
}

// TestShippedConfigStatesTheDefaults: the broker.kafka block of config.yaml
// documents every key with its default value.
func TestShippedConfigStatesTheDefaults(t *testing.T) {
	t.Parallel()
	cfg, err := bus.LoadConfig("../../config.yaml")
	require.NoError(t, err)
	got := cfg.Broker.Kafka
	want := kafka.Config{}.WithDefaults()
	want.Brokers, want.DevCluster = got.Brokers, got.DevCluster // KAFKA_BROKERS and KAFKA_DEV_CLUSTER may override these
	assert.Equal(t, want, got)
}
