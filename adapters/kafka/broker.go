package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/adapters"
)

// Broker is a Kafka connection with millrace's reliable defaults: one
// idempotent producer (acks=all) shared by Publisher and PublishBatch,
// watermill-kafka subscribers per consumer group, and an admin client for
// Provision. It is safe for concurrent use.
type Broker struct {
	cfg    Config
	opts   adapters.Options
	logger watermill.LoggerAdapter

	client   sarama.Client
	producer sarama.AsyncProducer
	admin    sarama.ClusterAdmin
	routed   sync.WaitGroup // the goroutine routing producer results
	// sendMu guards the producer's input: PublishBatch sends under RLock,
	// Close closes the producer under Lock, so nothing is sent after that.
	sendMu sync.RWMutex

	// provisioned holds the topics known to exist, so only the first
	// publish or subscribe on a topic asks the broker.
	provisioned sync.Map
	provisionMu sync.Mutex

	mu          sync.Mutex
	subscribers map[*subscriber]struct{}
	closed      atomic.Bool
	closing     chan struct{}
	closeOnce   sync.Once
	closeErr    error

	releaseDev func()
}

var _ adapters.Broker = (*Broker)(nil)

// Open connects with the reliable defaults of this adapter (see Config) and
// returns a *Broker that implements adapters.Broker. With cfg.DevCluster it
// first starts an in-process dev cluster on cfg.Brokers. An unreachable
// cluster is an error within opts.ConnectTimeout naming the addresses.
func Open(ctx context.Context, cfg Config, opts adapters.Options) (*Broker, error) {
	cfg = cfg.WithDefaults()
	opts = opts.WithDefaults()
	if problems := cfg.Validate("broker.kafka"); len(problems) > 0 {
		return nil, fmt.Errorf("kafka: invalid config: %w", errors.Join(problems...))
	}
	b := &Broker{
		cfg:         cfg,
		opts:        opts,
		logger:      opts.Logger,
		subscribers: map[*subscriber]struct{}{},
		closing:     make(chan struct{}),
	}
	cfg.TLS.WarnInsecure(b.logger, "broker.kafka.tls")
	if cfg.SASL.Mechanism == SASLPlain && !cfg.TLS.Enabled {
		b.logger.Error("INSECURE: broker.kafka.sasl.mechanism PLAIN without tls.enabled sends the password in clear text",
			errPlainWithoutTLS, nil)
	}
	if cfg.DevCluster {
		listening, release, err := acquireDevCluster(cfg.Brokers, cfg.ReplicationFactor)
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
	if b.producer, err = sarama.NewAsyncProducerFromClient(client); err != nil {
		_ = client.Close()
		b.release()
		return nil, fmt.Errorf("kafka: cannot create the producer: %w", err)
	}
	if b.admin, err = sarama.NewClusterAdminFromClient(client); err != nil {
		_ = b.producer.Close()
		_ = client.Close()
		b.release()
		return nil, fmt.Errorf("kafka: cannot create the admin client: %w", err)
	}
	b.routed.Add(1)
	go b.routeResults()
	return b, nil
}

// connect returns a client that has fetched the cluster's metadata, or an
// error naming the brokers once opts.ConnectTimeout has passed.
func connect(ctx context.Context, cfg Config, opts adapters.Options) (sarama.Client, error) {
	conf, err := producerConfig(cfg, opts)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, opts.ConnectTimeout)
	defer cancel()
	type result struct {
		client sarama.Client
		err    error
	}
	done := make(chan result, 1)
	go func() {
		c, err := sarama.NewClient(cfg.Brokers, conf)
		done <- result{c, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			hint := ""
			if errors.Is(r.err, io.EOF) {
				hint = " (a broker that closes the connection at once usually refused the SASL credentials or expects TLS)"
			}
			return nil, fmt.Errorf("kafka: cannot reach brokers %s over %s: %w%s",
				strings.Join(cfg.Brokers, ","), cfg.security(), r.err, hint)
		}
		return r.client, nil
	case <-ctx.Done():
		go func() { // the attempt ends within Net.DialTimeout; close what it made
			if r := <-done; r.client != nil {
				_ = r.client.Close()
			}
		}()
		return nil, fmt.Errorf("kafka: cannot reach brokers %s over %s within %s: %w",
			strings.Join(cfg.Brokers, ","), cfg.security(), opts.ConnectTimeout, ctx.Err())
	}
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

// baseConfig holds the Sarama settings producers, consumers and the admin
// client share.
func baseConfig(cfg Config, opts adapters.Options) (*sarama.Config, error) {
	version, err := sarama.ParseKafkaVersion(cfg.Version)
	if err != nil {
		return nil, err
	}
	c := sarama.NewConfig()
	c.Version = version
	c.ClientID = cfg.ClientID
	c.Net.DialTimeout = opts.ConnectTimeout
	// Topics are created by millrace with the configured partitions and
	// replication factor, never implicitly with the broker's defaults.
	c.Metadata.AllowAutoTopicCreation = false
	c.Admin.Timeout = max(c.Admin.Timeout, cfg.ProducerTimeout)
	if err := applySecurity(c, cfg); err != nil {
		return nil, err
	}
	return c, nil
}

// producerConfig is the idempotent, acks=all producer: no duplicates from
// its own retries and per-partition order kept across them.
func producerConfig(cfg Config, opts adapters.Options) (*sarama.Config, error) {
	c, err := baseConfig(cfg, opts)
	if err != nil {
		return nil, err
	}
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Idempotent = true
	c.Net.MaxOpenRequests = 1 // Sarama's idempotent producer requires it
	c.Producer.Retry.Max = cfg.ProducerRetries
	c.Producer.Retry.Backoff = cfg.ProducerRetryBackoff
	c.Producer.Timeout = cfg.ProducerTimeout
	c.Producer.MaxMessageBytes = cfg.MaxMessageBytes
	c.Producer.Partitioner = newKeyPartitioner
	c.Producer.Return.Successes = true
	c.Producer.Return.Errors = true
	switch cfg.Compression {
	case CompressionGzip:
		c.Producer.Compression = sarama.CompressionGZIP
	case CompressionSnappy:
		c.Producer.Compression = sarama.CompressionSnappy
	case CompressionLZ4:
		c.Producer.Compression = sarama.CompressionLZ4
	case CompressionZstd:
		c.Producer.Compression = sarama.CompressionZSTD
	default:
		c.Producer.Compression = sarama.CompressionNone
	}
	return c, c.Validate()
}

// consumerConfig is the consumer-group side: new groups start at the oldest
// offset (Sarama's default, the newest, would skip every event published
// before the group first joined), only acked messages are committed, and
// records of aborted transactions are never read.
func consumerConfig(cfg Config, opts adapters.Options) (*sarama.Config, error) {
	c, err := baseConfig(cfg, opts)
	if err != nil {
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

// Close closes every subscriber this Broker made, waits for messages still
// in flight in the producer, and closes the connections. It is idempotent.
func (b *Broker) Close() error {
	b.closeOnce.Do(func() {
		b.closed.Store(true)
		close(b.closing)
		b.mu.Lock()
		subs := make([]*subscriber, 0, len(b.subscribers))
		for s := range b.subscribers {
			subs = append(subs, s)
		}
		b.mu.Unlock()
		var errs []error
		for _, s := range subs {
			errs = append(errs, s.Close())
		}
		b.sendMu.Lock()
		b.producer.AsyncClose() // results keep flowing to routeResults until both channels close
		b.sendMu.Unlock()
		b.routed.Wait()
		if err := b.client.Close(); err != nil && !errors.Is(err, sarama.ErrClosedClient) {
			errs = append(errs, err)
		}
		b.release()
		b.closeErr = errors.Join(errs...)
	})
	return b.closeErr
}

var errPlainWithoutTLS = errors.New("SASL PLAIN over a plaintext connection: use tls.enabled: true or a SCRAM mechanism")

// ErrClosed is returned by calls on a closed Broker.
var ErrClosed = errors.New("kafka: broker closed")
