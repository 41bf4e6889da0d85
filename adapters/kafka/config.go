package kafka

import (
	"cmp"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/IBM/sarama"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka/internal/devcluster"
	"github.com/millrace-io/millrace/internal/confload"
)

// Kind is the broker.kind of this adapter, and its section's key under
// broker in config.yaml.
const Kind = "kafka"

// KafkadevPackage is the package that links the dev cluster into a program
// when imported.
const KafkadevPackage = "github.com/millrace-io/millrace/adapters/kafka/kafkadev"

// Compression codecs accepted by broker.kafka.compression.
const (
	CompressionNone   = "none"
	CompressionGzip   = "gzip"
	CompressionSnappy = "snappy"
	CompressionLZ4    = "lz4"
	CompressionZstd   = "zstd"
)

// SASL mechanisms accepted by broker.kafka.sasl.mechanism.
const (
	SASLPlain       = "PLAIN"
	SASLScramSHA256 = "SCRAM-SHA-256"
	SASLScramSHA512 = "SCRAM-SHA-512"
)

// Config is the broker.kafka section of config.yaml. Each field's comment
// gives its YAML key's default; WithDefaults applies them.
type Config struct {
	// Brokers are the bootstrap broker addresses (host:port). KAFKA_BROKERS
	// (comma separated) overrides it. Defaults to [127.0.0.1:9092].
	Brokers []string `yaml:"brokers"`

	// DevCluster, when true, makes Open start an in-process Kafka-protocol
	// cluster (kfake) listening on Brokers, for demos and tests only: it has
	// no replication, keeps its data in memory and dies with the process.
	// It needs package kafkadev imported (KafkadevPackage). Defaults to
	// false.
	DevCluster bool `yaml:"dev_cluster"`

	// Version is the Kafka protocol version the subscribers (Sarama, through
	// watermill-kafka) speak; at least 0.11.0 (read_committed consumers need
	// it). The producer and the admin requests (franz-go) negotiate their
	// versions with the brokers. Defaults to "2.8.0", the newest version
	// Sarama fully covers, which Kafka 2.8 to 4.x brokers accept.
	Version string `yaml:"version"`
	// ClientID names this client in broker logs and quotas. Defaults to "millrace".
	ClientID string `yaml:"client_id"`

	// Partitions is the partition count of topics millrace creates. It caps
	// how many consumers of one group work in parallel; changing it later
	// moves keys to other partitions. Defaults to 6.
	Partitions int `yaml:"partitions"`
	// ReplicationFactor is the replica count of topics millrace creates.
	// Defaults to 3.
	ReplicationFactor int `yaml:"replication_factor"`
	// MinInsyncReplicas is the topic's min.insync.replicas for topics millrace
	// creates: with acks=all, a write succeeds only once this many replicas
	// have it. At most ReplicationFactor. Defaults to 2, or 1 when
	// ReplicationFactor is 1.
	MinInsyncReplicas int `yaml:"min_insync_replicas"`
	// AutoProvision makes the first publish to or subscribe on a missing topic
	// create it with Partitions, ReplicationFactor and MinInsyncReplicas.
	// Brokers never auto-create topics for millrace (they would use the
	// broker's num.partitions and default.replication.factor, often 1).
	// Defaults to true.
	AutoProvision *bool `yaml:"auto_provision"`

	// MaxMessageBytes is the largest record batch the producer sends; a
	// message that does not fit a batch of its own (payload, key, headers
	// and about 100 bytes of framing) fails at once with a permanent error.
	// Keep it at or under the broker's message.max.bytes. Defaults to 1048576.
	MaxMessageBytes int `yaml:"max_message_bytes"`
	// Compression is the producer's batch codec: none, gzip, snappy, lz4 or
	// zstd. Defaults to "snappy": the subscribers' Sarama decodes each lz4
	// record batch into a buffer of the 4MB block size kgo's lz4 writer
	// declares, while holding the broker connection its group heartbeats
	// share (see README.md).
	Compression string `yaml:"compression"`
	// ProducerRetries is how often the producer sends a record batch again
	// that the broker did not acknowledge, and ProducerRetries times
	// ProducerRetryBackoff is how long it keeps trying to deliver a record
	// (franz-go's RecordRetries and RecordDeliveryTimeout, like Kafka's own
	// delivery.timeout.ms of 2m): the broker outage the relay rides out
	// inside one publish. After that the records fail, retryably, and every
	// later record of their partitions fails with them, so the relay sends
	// them again in order. A request whose outcome the producer cannot know
	// (written, never answered) is retried until the broker answers; a
	// publish waits for it up to that time plus ProducerTimeout. Their
	// product is at least 1s. Defaults to 480 (2 minutes at 250ms).
	ProducerRetries int `yaml:"producer_retries"`
	// ProducerRetryBackoff is the wait between those resends, and between
	// the client's other retries. Defaults to 250ms.
	ProducerRetryBackoff time.Duration `yaml:"producer_retry_backoff"`
	// ProducerTimeout is how long the broker may take to gather the acks of
	// all in-sync replicas. Defaults to 10s.
	ProducerTimeout time.Duration `yaml:"producer_timeout"`

	// SessionTimeout is how long a consumer may go without heartbeats before
	// the group drops it and gives its partitions to others. Defaults to 10s.
	SessionTimeout time.Duration `yaml:"session_timeout"`
	// HeartbeatInterval is how often consumers heartbeat; a rebalance reaches
	// the other members of a group within about this time. Less than
	// SessionTimeout. Defaults to 3s.
	HeartbeatInterval time.Duration `yaml:"heartbeat_interval"`
	// RebalanceTimeout is how long members get to let go of their in-flight
	// messages (whose contexts end with the session, see Subscriber) and
	// rejoin during a rebalance; a member that takes longer is dropped from
	// the group until it rejoins. At least twice HeartbeatInterval (a member
	// learns of a rebalance at its next heartbeat). Defaults to 60s.
	RebalanceTimeout time.Duration `yaml:"rebalance_timeout"`
	// JoinWait is how long Subscribe waits for the consumer's first
	// partition assignment, so consumers started together settle before
	// messages flow (a rebalance under traffic redelivers in-flight
	// messages). If the group has not settled by then, Subscribe returns
	// anyway and consumption starts once it does. Defaults to 5s.
	JoinWait time.Duration `yaml:"join_wait"`
	// CommitInterval is how often the offsets of acked messages are
	// committed; only acked messages are ever committed. 0 commits
	// synchronously after every ack (one broker round trip per message).
	// A crash redelivers at most this much acked work. Defaults to 1s.
	CommitInterval *time.Duration `yaml:"commit_interval"`
	// NackRedeliveryDelay is how long a nacked message waits before it is
	// delivered again to the same subscriber. Defaults to 100ms.
	NackRedeliveryDelay time.Duration `yaml:"nack_redelivery_delay"`
	// RetryTopics hands the waits between the attempts of an unordered
	// handler (retry.mode auto) to a retry topic per topic and group
	// (RetryTopicName): a failed message is parked there, with its delivery
	// number and the time of its next attempt in headers, and consumed again
	// by the same group once that time has come, so it holds no worker and
	// its attempt count survives consumer restarts. A parked message lets
	// newer ones pass it, which is why ordered handlers never use it.
	// Defaults to false: every wait is in process.
	RetryTopics bool `yaml:"retry_topics"`
	// ReconnectDelay is the wait between attempts to reconnect a subscription
	// whose broker connection failed. Defaults to 1s.
	ReconnectDelay time.Duration `yaml:"reconnect_delay"`

	// TLS encrypts and authenticates the connections to the brokers
	// (Kafka's SSL and SASL_SSL listeners). Defaults to off.
	TLS adapters.TLSConfig `yaml:"tls"`
	// SASL authenticates this client to the brokers. Defaults to off.
	SASL SASLConfig `yaml:"sasl"`
}

// SASLConfig is broker.kafka.sasl: the credentials of this client. Take the
// password from the environment or a mounted file (${KAFKA_PASSWORD},
// ${file:/run/secrets/kafka}); it never appears in errors or logs.
type SASLConfig struct {
	// Mechanism is PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512. PLAIN sends the
	// password itself, so use it only with tls.enabled (Open logs an
	// error-level warning otherwise). Defaults to "": no SASL.
	Mechanism string `yaml:"mechanism"`
	// User is the SASL user name. Required with a mechanism. Defaults to "".
	User string `yaml:"user"`
	// Password is the user's password. Required with a mechanism. Defaults to "".
	Password string `yaml:"password"`
}

// Defaults of the settings that are not zero values.
const (
	DefaultBroker            = "127.0.0.1:9092"
	DefaultVersion           = "2.8.0"
	DefaultClientID          = "millrace"
	DefaultPartitions        = 6
	DefaultReplicationFactor = 3
	DefaultMaxMessageBytes   = 1024 * 1024
)

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	if len(c.Brokers) == 0 {
		c.Brokers = []string{DefaultBroker}
	}
	c.Version = cmp.Or(c.Version, DefaultVersion)
	c.ClientID = cmp.Or(c.ClientID, DefaultClientID)
	c.Partitions = cmp.Or(c.Partitions, DefaultPartitions)
	c.ReplicationFactor = cmp.Or(c.ReplicationFactor, DefaultReplicationFactor)
	if c.MinInsyncReplicas == 0 {
		c.MinInsyncReplicas = min(2, c.ReplicationFactor)
	}
	if c.AutoProvision == nil {
		c.AutoProvision = new(true)
	}
	c.MaxMessageBytes = cmp.Or(c.MaxMessageBytes, DefaultMaxMessageBytes)
	c.Compression = cmp.Or(c.Compression, CompressionSnappy)
	c.ProducerRetries = cmp.Or(c.ProducerRetries, 480)
	c.ProducerRetryBackoff = cmp.Or(c.ProducerRetryBackoff, 250*time.Millisecond)
	c.ProducerTimeout = cmp.Or(c.ProducerTimeout, 10*time.Second)
	c.SessionTimeout = cmp.Or(c.SessionTimeout, 10*time.Second)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, 3*time.Second)
	c.RebalanceTimeout = cmp.Or(c.RebalanceTimeout, 60*time.Second)
	c.JoinWait = cmp.Or(c.JoinWait, 5*time.Second)
	if c.CommitInterval == nil {
		c.CommitInterval = new(time.Second)
	}
	c.NackRedeliveryDelay = cmp.Or(c.NackRedeliveryDelay, 100*time.Millisecond)
	c.ReconnectDelay = cmp.Or(c.ReconnectDelay, time.Second)
	c.TLS = c.TLS.WithDefaults()
	return c
}

// Validate returns every problem in c, each naming its YAML path under path.
// Call it on a Config that has had WithDefaults applied.
func (c Config) Validate(path string) []error {
	var chk confload.Checker
	at := func(key string) string { return confload.Join(path, key) }
	c.validateBrokers(&chk, at)
	if v, err := sarama.ParseKafkaVersion(c.Version); err != nil {
		chk.Add(at("version"), "not a Kafka version such as \"2.8.0\"; got %q", c.Version)
	} else if !v.IsAtLeast(sarama.V0_11_0_0) {
		chk.Add(at("version"), "must be at least 0.11.0 (read_committed consumers need it); got %q", c.Version)
	}
	chk.Positive(at("partitions"), c.Partitions)
	chk.Positive(at("replication_factor"), c.ReplicationFactor)
	chk.Positive(at("min_insync_replicas"), c.MinInsyncReplicas)
	if c.MinInsyncReplicas > c.ReplicationFactor {
		chk.Add(at("min_insync_replicas"), "must be at most replication_factor (%d); got %d",
			c.ReplicationFactor, c.MinInsyncReplicas)
	}
	c.validateProducer(&chk, at)
	c.validateGroup(&chk, at)
	chk.Merge(c.TLS.Validate(at("tls"), c.TLS.Enabled))
	c.SASL.validate(&chk, at("sasl"))
	if c.DevCluster && (c.TLS.Enabled || c.SASL.Mechanism != "") {
		chk.Add(at("dev_cluster"), "the in-process dev cluster speaks neither TLS nor SASL; turn tls and sasl off with dev_cluster: true")
	}
	return chk.Problems
}

// validateBrokers adds the problems of brokers and dev_cluster to chk.
func (c Config) validateBrokers(chk *confload.Checker, at func(string) string) {
	if len(c.Brokers) == 0 {
		chk.Add(at("brokers"), "required: at least one host:port")
	}
	for i, b := range c.Brokers {
		p := fmt.Sprintf("%s[%d]", at("brokers"), i)
		if b == "" {
			chk.Add(p, "must not be empty")
			continue
		}
		if _, port, err := net.SplitHostPort(b); err != nil {
			chk.Add(p, "must be host:port; got %q", b)
		} else if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
			chk.Add(p, "port must be a number from 0 to 65535; got %q", b)
		}
	}
	if c.DevCluster {
		if !devcluster.Starter.Linked() {
			chk.Add(at("dev_cluster"), "%s: import _ %q in a development or test program to run it, or set it to false and point %s at Kafka",
				devcluster.ErrNotLinked, KafkadevPackage, at("brokers"))
		}
		for i, b := range c.Brokers {
			if host, _, err := net.SplitHostPort(b); err == nil && !devcluster.IsLoopback(host) {
				chk.Add(fmt.Sprintf("%s[%d]", at("brokers"), i),
					"with dev_cluster: true the in-process cluster listens on 127.0.0.1 only; got %q", b)
			}
		}
	}
}

// validateProducer adds the problems of the producer's settings to chk.
func (c Config) validateProducer(chk *confload.Checker, at func(string) string) {
	if c.MaxMessageBytes < 1024 || c.MaxMessageBytes >= int(sarama.MaxRequestSize) {
		chk.Add(at("max_message_bytes"), "must be from 1024 to %d; got %d", sarama.MaxRequestSize-1, c.MaxMessageBytes)
	}
	chk.OneOf(at("compression"), c.Compression,
		CompressionNone, CompressionGzip, CompressionSnappy, CompressionLZ4, CompressionZstd)
	chk.Positive(at("producer_retries"), c.ProducerRetries)
	chk.PositiveDuration(at("producer_retry_backoff"), c.ProducerRetryBackoff)
	if c.ProducerRetries > 0 && c.ProducerRetryBackoff > 0 && c.deliveryTimeout() < time.Second {
		chk.Add(at("producer_retries"), "times producer_retry_backoff (%s) must be at least 1s, the shortest delivery timeout of the producer; got %d x %s",
			c.ProducerRetryBackoff, c.ProducerRetries, c.ProducerRetryBackoff)
	}
	chk.PositiveDuration(at("producer_timeout"), c.ProducerTimeout)
}

// validateGroup adds the problems of the consumer group's settings to chk.
func (c Config) validateGroup(chk *confload.Checker, at func(string) string) {
	chk.PositiveDuration(at("session_timeout"), c.SessionTimeout)
	chk.PositiveDuration(at("heartbeat_interval"), c.HeartbeatInterval)
	if c.HeartbeatInterval >= c.SessionTimeout {
		chk.Add(at("heartbeat_interval"), "must be less than session_timeout (%s); got %s",
			c.SessionTimeout, c.HeartbeatInterval)
	}
	chk.PositiveDuration(at("rebalance_timeout"), c.RebalanceTimeout)
	// A member learns of a rebalance at its next heartbeat and must then let
	// go of its messages and rejoin within rebalance_timeout; with less room
	// members that hold messages keep dropping each other out of the group.
	if c.RebalanceTimeout < 2*c.HeartbeatInterval {
		chk.Add(at("rebalance_timeout"), "must be at least twice heartbeat_interval (%s); got %s",
			c.HeartbeatInterval, c.RebalanceTimeout)
	}
	chk.PositiveDuration(at("join_wait"), c.JoinWait)
	if c.CommitInterval != nil {
		chk.NonNegativeDuration(at("commit_interval"), *c.CommitInterval)
	}
	chk.PositiveDuration(at("nack_redelivery_delay"), c.NackRedeliveryDelay)
	chk.PositiveDuration(at("reconnect_delay"), c.ReconnectDelay)
}

func (s SASLConfig) validate(chk *confload.Checker, path string) {
	at := func(key string) string { return confload.Join(path, key) }
	if s.Mechanism == "" {
		if s.User != "" || s.Password != "" {
			chk.Add(at("mechanism"), "required when user or password is set: one of %s, %s, %s", SASLPlain, SASLScramSHA256, SASLScramSHA512)
		}
		return
	}
	chk.OneOf(at("mechanism"), s.Mechanism, SASLPlain, SASLScramSHA256, SASLScramSHA512)
	if s.User == "" {
		chk.Add(at("user"), "required with mechanism %s", s.Mechanism)
	}
	if s.Password == "" {
		chk.Add(at("password"), "required with mechanism %s", s.Mechanism)
	}
}
