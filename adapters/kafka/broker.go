package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/internal/adapterkit"
	"github.com/millrace-io/millrace/adapters/kafka/internal/devcluster"
	"github.com/millrace-io/millrace/internal/sleep"
)

// Broker is a Kafka connection with millrace's reliable defaults: one
// franz-go client (kgo) with the idempotent producer (acks=all) that
// Publisher and PublishBatch share and that Provision's admin requests go
// through, plus watermill-kafka (Sarama) subscribers per consumer group. It
// is safe for concurrent use.
type Broker struct {
	cfg    Config
	rules  rules
	opts   adapters.Options
	logger watermill.LoggerAdapter

	client *kgo.Client
	admin  *kadm.Client
	// publishing is held by one send at a time, from before its first
	// record goes to the client until the client has resolved every record
	// it was given (see send for why order depends on it).
	publishing chan struct{}
	// sending counts the sends holding publishing, so Close waits for them;
	// closeMu orders a send's check of closed before Close's wait.
	sending sync.WaitGroup
	closeMu sync.RWMutex
	// flushCtx ends the sends' flushes at Close.
	flushCtx     context.Context
	stopFlushing context.CancelFunc

	// provisioned holds the topics known to exist, so only the first
	// publish or subscribe on a topic asks the broker.
	provisioned sync.Map
	provisionMu sync.Mutex
	// purge holds topics the broker reported unknown: the next send drops
	// what the client knows of them (a recreated topic has a new topic id
	// the client would otherwise refuse).
	purge sync.Map

	mu          sync.Mutex
	subscribers map[*subscriber]struct{}
	closed      atomic.Bool
	closing     chan struct{}
	closeOnce   sync.Once
	closeErr    error

	releaseDev func()
}

// Open connects with the reliable defaults of this adapter (see Config) and
// returns a *Broker that implements adapters.Broker. With cfg.DevCluster it
// first starts an in-process dev cluster on cfg.Brokers, which needs package
// kafkadev imported. An unreachable
// cluster is an error within opts.ConnectTimeout naming the addresses.
func Open(ctx context.Context, cfg Config, opts adapters.Options) (*Broker, error) {
	return adapterkit.Open(ctx, Kind, cfg, opts, open)
}

// Connect is Open for a Config that has its defaults and that Validate
// accepted (adapters.Section).
func (c Config) Connect(ctx context.Context, opts adapters.Options) (adapters.Broker, error) {
	return adapterkit.Connect(ctx, c, opts, open)
}

func open(ctx context.Context, cfg Config, opts adapters.Options) (*Broker, error) {
	b := &Broker{
		cfg:         cfg,
		rules:       cfg.Rules().(rules),
		opts:        opts,
		logger:      opts.Logger,
		publishing:  make(chan struct{}, 1),
		subscribers: map[*subscriber]struct{}{},
		closing:     make(chan struct{}),
	}
	cfg.TLS.WarnInsecure(b.logger, "broker.kafka.tls")
	if cfg.SASL.Mechanism == SASLPlain && !cfg.TLS.Enabled {
		b.logger.Error("INSECURE: broker.kafka.sasl.mechanism PLAIN without tls.enabled sends the password in clear text",
			errPlainWithoutTLS, nil)
	}
	if cfg.DevCluster {
		listening, release, err := devcluster.Acquire(cfg.Brokers, cfg.ReplicationFactor)
		if err != nil {
			return nil, err
		}
		b.releaseDev = release
		cfg.Brokers = listening
		b.cfg.Brokers = listening
		b.logger.Info("Using the in-process Kafka dev cluster (kfake); not for production", watermill.LogFields{
			"brokers": strings.Join(listening, ","),
		})
	}

	client, err := connect(ctx, cfg, opts)
	if err != nil {
		b.release()
		return nil, err
	}
	b.client = client
	b.admin = kadm.NewClient(client)
	b.flushCtx, b.stopFlushing = context.WithCancel(context.Background())
	return b, nil
}

// connect returns a client that has reached a broker, or an error naming the
// brokers once opts.ConnectTimeout has passed. Refused connections are
// tried again until then; a failed TLS handshake or login is reported at once.
func connect(ctx context.Context, cfg Config, opts adapters.Options) (*kgo.Client, error) {
	kopts, err := clientOptions(cfg, opts)
	if err != nil {
		return nil, err
	}
	client, err := kgo.NewClient(kopts...)
	if err != nil {
		return nil, fmt.Errorf("kafka: invalid client settings: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, opts.ConnectTimeout)
	defer cancel()
	for {
		if err = client.Ping(ctx); err == nil {
			return client, nil
		}
		var opErr *net.OpError
		if !errors.As(err, &opErr) || opErr.Op != "dial" || !sleep.For(ctx, 250*time.Millisecond) {
			break
		}
	}
	client.Close()
	hint := ""
	if errors.Is(err, io.EOF) || errors.Is(err, kerr.SaslAuthenticationFailed) {
		hint = " (a broker that closes the connection at once or fails the login usually refused the SASL credentials or expects TLS)"
	}
	where := fmt.Sprintf("brokers %s over %s", strings.Join(cfg.Brokers, ","), cfg.security())
	if ctx.Err() != nil {
		return nil, adapterkit.Unreachable(Kind, where, fmt.Errorf("no answer within %s (broker.connect_timeout): %w%s", opts.ConnectTimeout, err, hint))
	}
	return nil, adapterkit.Unreachable(Kind, where, fmt.Errorf("%w%s", err, hint))
}

// security describes how connections are secured, for errors: never the password.
func (cfg Config) security() string {
	s := "plaintext"
	if cfg.TLS.Enabled {
		s = "TLS"
	}
	if cfg.SASL.Mechanism != "" {
		s += fmt.Sprintf(" with SASL %s as user %q", cfg.SASL.Mechanism, cfg.SASL.User)
	}
	return s
}

// clientOptions are the franz-go client's settings: the connection, and the
// producer of Publisher and PublishBatch.
//
// The producer is kgo's rather than Sarama's for order and for speed.
// Order: kgo keeps a partition gapless when a record batch fails (it fails
// every record buffered behind it in the partition too, and renumbers what
// comes after under a new producer epoch), where Sarama's idempotent
// producer went on sending the batches behind a failed one; with send's
// rules that keeps each aggregate's order across broker crashes
// (TestRelayKeepsOrderAcrossClusterCrashes: Sarama 4 to 26 inversions per
// run, kgo none). Speed: internal/testing/relaybench, the relay in its own process
// draining a 50,000-event backlog into kfake on a 2-core machine, then a
// 200 events/s trickle for commit-to-consumer latency, alternating runs at
// a 1-minute load average of 1.0 to 1.9:
//
//	client  drain msg/s, each run     median   p50        p99
//	Sarama  29717 24327 17643 18029   ~21000   0.9-1.2ms  2.2-15.3ms
//	kgo     24185 29855 28380 32372   ~29000   1.1ms      2.5-6.6ms
//
// The relay's peak RSS is about 75MB with kgo against 45MB with Sarama
// (both measured with lz4, whose kgo writers buffer 4MB blocks; 47MB with
// compression: none).
func clientOptions(cfg Config, opts adapters.Options) ([]kgo.Opt, error) {
	codec, err := compressionCodec(cfg.Compression)
	if err != nil {
		return nil, err
	}
	backoff := cfg.ProducerRetryBackoff
	kopts := []kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.ClientID(cfg.ClientID),
		kgo.DialTimeout(opts.ConnectTimeout),
		kgo.WithLogger(kgoLogger{opts.Logger}),
		// millrace exports its own metrics; no KIP-714 pushes, and Close
		// does not wait for a last one.
		kgo.DisableClientMetrics(),
		kgo.RetryBackoffFn(func(int) time.Duration { return backoff }),
		// After a broker comes back, producing waits for a metadata
		// refresh; kgo's default minimum age of 5s between refreshes
		// would hold up every recovery that long.
		kgo.MetadataMinAge(backoff),
		// kgo never asks brokers to auto-create topics unless told to:
		// millrace creates them with the configured settings (Provision).

		// The producer: idempotent (kgo's default) with acks from all
		// in-sync replicas.
		kgo.RequiredAcks(kgo.AllISRAcks()),
		// The record key is the aggregate id, placed as Kafka's Java client
		// places it (murmur2), so other clients agree on an aggregate's
		// partition; records without a key spread over the partitions.
		kgo.RecordPartitioner(keyPartitioner),
		// Nothing is sent until send flushes: see send.
		kgo.ManualFlushing(),
		// One call's records are buffered at once before the flush; the
		// caller holds them in memory anyway, and calls do not overlap.
		kgo.MaxBufferedRecords(math.MaxInt32),
		kgo.ProducerBatchMaxBytes(int32(cfg.MaxMessageBytes)),
		kgo.ProducerBatchCompression(codec, kgo.NoCompression()),
		kgo.ProduceRequestTimeout(cfg.ProducerTimeout),
		kgo.RecordRetries(cfg.ProducerRetries),
		kgo.RecordDeliveryTimeout(cfg.deliveryTimeout()),
	}
	security, err := securityOptions(cfg)
	if err != nil {
		return nil, err
	}
	return append(kopts, security...), nil
}

// deliveryTimeout is how long the producer tries to deliver a record before
// it fails it (retryably): broker.kafka.producer_retries times
// producer_retry_backoff.
func (cfg Config) deliveryTimeout() time.Duration {
	return time.Duration(cfg.ProducerRetries) * cfg.ProducerRetryBackoff
}

// keyPartitioner places keyed records by murmur2(key) masked to 31 bits
// modulo the partition count, as Kafka's Java client does, waiting for
// that partition when it has no leader; records without a key stick to one
// partition per batch and so spread over the partitions.
var keyPartitioner = kgo.StickyKeyPartitioner(nil)

func compressionCodec(name string) (kgo.CompressionCodec, error) {
	switch name {
	case CompressionNone:
		return kgo.NoCompression(), nil
	case CompressionGzip:
		return kgo.GzipCompression(), nil
	case CompressionSnappy:
		return kgo.SnappyCompression(), nil
	case CompressionLZ4:
		return kgo.Lz4Compression(), nil
	case CompressionZstd:
		return kgo.ZstdCompression(), nil
	}
	return kgo.CompressionCodec{}, fmt.Errorf("kafka: broker.kafka.compression %q is not a codec", name)
}

// consumerConfig is the Sarama configuration of the watermill-kafka
// subscribers: a group with no committed offset starts at the oldest offset
// (Sarama's default, the newest, would skip every event published before
// the group first joined; Provision and ProvisionGroup commit a new
// group's start, so this only applies to a group nobody provisioned),
// only acked messages are committed, records of aborted transactions are
// never read, and topics are never auto-created by a subscription.
func consumerConfig(cfg Config, opts adapters.Options) (*sarama.Config, error) {
	version, err := sarama.ParseKafkaVersion(cfg.Version)
	if err != nil {
		return nil, err
	}
	c := sarama.NewConfig()
	c.Version = version
	c.ClientID = cfg.ClientID
	c.Net.DialTimeout = opts.ConnectTimeout
	c.Metadata.AllowAutoTopicCreation = false
	if err := applySecurity(c, cfg); err != nil {
		return nil, err
	}
	c.Consumer.Return.Errors = true
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Enable = *cfg.CommitInterval > 0
	if *cfg.CommitInterval > 0 {
		c.Consumer.Offsets.AutoCommit.Interval = *cfg.CommitInterval
	}
	c.Consumer.IsolationLevel = sarama.ReadCommitted
	c.Consumer.Group.Session.Timeout = cfg.SessionTimeout
	c.Consumer.Group.Heartbeat.Interval = cfg.HeartbeatInterval
	c.Consumer.Group.Rebalance.Timeout = cfg.RebalanceTimeout
	return c, c.Validate()
}

// release gives back the dev cluster, if this Broker started or joined one.
func (b *Broker) release() {
	if b.releaseDev != nil {
		b.releaseDev()
	}
}

// Close closes every subscriber this Broker made and the client. Records
// still unconfirmed fail with errClosed (the relay publishes them again);
// Close does not wait for them. It is idempotent.
func (b *Broker) Close() error {
	b.closeOnce.Do(func() {
		b.closeMu.Lock()
		b.closed.Store(true)
		b.closeMu.Unlock()
		close(b.closing)
		b.mu.Lock()
		subs := maps.Clone(b.subscribers)
		b.mu.Unlock()
		b.closeErr = adapterkit.CloseAll(maps.Keys(subs))
		b.stopFlushing()
		b.client.Close() // fails what is still buffered, so every send ends
		b.sending.Wait()
		b.release()
	})
	return b.closeErr
}

var errPlainWithoutTLS = errors.New("SASL PLAIN over a plaintext connection: use tls.enabled: true or a SCRAM mechanism")

// errClosed is returned by calls on a closed Broker.
var errClosed = fmt.Errorf("kafka: %w", adapters.ErrClosed)

// kgoLogger hands the client's warnings and errors to the Broker's logger
// (warnings at info level, which Watermill's loggers have instead).
type kgoLogger struct{ logger watermill.LoggerAdapter }

func (l kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelWarn }

func (l kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	fields := watermill.LogFields{}
	var err error
	for i := 0; i+1 < len(keyvals); i += 2 {
		key := fmt.Sprint(keyvals[i])
		if e, ok := keyvals[i+1].(error); ok && key == "err" {
			err = e
			continue
		}
		fields[key] = keyvals[i+1]
	}
	if level == kgo.LogLevelError {
		l.logger.Error("Kafka client: "+msg, err, fields)
		return
	}
	if err != nil {
		fields["err"] = err.Error()
	}
	l.logger.Info("Kafka client: "+msg, fields)
}
