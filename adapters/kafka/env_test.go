package kafka_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
)

// Tests run against a real Kafka cluster when KAFKA_BROKERS is set (comma
// separated host:port), else against in-process dev clusters (kfake). With a
// real cluster, KAFKA_REPLICATION_FACTOR sets the replication factor of the
// topics tests create (default 1, so a one-broker cluster works).

// realBrokers returns KAFKA_BROKERS, or nil when tests use dev clusters.
func realBrokers() []string {
	v := strings.TrimSpace(os.Getenv("KAFKA_BROKERS"))
	if v == "" {
		return nil
	}
	var out []string
	for _, b := range strings.Split(v, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}

// testEnv is the cluster one test (or suite) talks to.
type testEnv struct {
	brokers []string
	rf      int
	// dev is the dev cluster, nil against a real cluster.
	dev     *kafkadev.Cluster
	dataDir string
}

// newEnv returns the real cluster, or starts a dev cluster for t that keeps
// its data in a directory so restart can bring it back.
func newEnv(t *testing.T) *testEnv {
	t.Helper()
	if brokers := realBrokers(); brokers != nil {
		rf := 1
		if v := os.Getenv("KAFKA_REPLICATION_FACTOR"); v != "" {
			n, err := strconv.Atoi(v)
			require.NoError(t, err, "KAFKA_REPLICATION_FACTOR")
			rf = n
		}
		return &testEnv{brokers: brokers, rf: rf}
	}
	e := &testEnv{rf: kafka.DefaultReplicationFactor, dataDir: t.TempDir()}
	dev, err := kafkadev.Start(kafkadev.Options{Addrs: []string{"127.0.0.1:0"}, DataDir: e.dataDir})
	require.NoError(t, err)
	e.dev = dev
	e.brokers = dev.Addrs()[:1]
	t.Cleanup(func() { e.dev.Close() })
	return e
}

// restartable reports whether restart can stop and start the cluster.
func (e *testEnv) restartable() bool { return e.dev != nil }

// stop stops the dev cluster; start brings it back on the same addresses
// with the data it had.
func (e *testEnv) stop() { e.dev.Close() }

func (e *testEnv) start(t *testing.T) {
	t.Helper()
	addrs := e.dev.Addrs()
	var dev *kafkadev.Cluster
	// The old listeners are closed; retry briefly in case the kernel is
	// still releasing a port.
	require.Eventually(t, func() bool {
		var err error
		dev, err = kafkadev.Start(kafkadev.Options{Addrs: addrs, DataDir: e.dataDir})
		return err == nil
	}, 30*time.Second, 100*time.Millisecond, "restarting the dev cluster on %v", addrs)
	e.dev = dev
}

func (e *testEnv) restart(t *testing.T) {
	e.stop()
	e.start(t)
}

// config returns the adapter configuration tests use: the defaults, with a
// short heartbeat so rebalances settle quickly.
func (e *testEnv) config() kafka.Config {
	return kafka.Config{
		Brokers:           e.brokers,
		ReplicationFactor: e.rf,
		HeartbeatInterval: 500 * time.Millisecond,
	}
}

// open opens a Broker on cfg and closes it when t ends.
func open(t *testing.T, cfg kafka.Config) *kafka.Broker {
	t.Helper()
	b, err := kafka.Open(context.Background(), cfg, adapters.Options{ConnectTimeout: 30 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	return b
}
