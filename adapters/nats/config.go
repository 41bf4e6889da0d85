package nats

import (
	"cmp"
	"errors"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/internal/adapterkit"
	"github.com/millrace-io/millrace/adapters/nats/internal/embed"
	"github.com/millrace-io/millrace/internal/confload"
)

// Kind is the broker.kind of this adapter, and its section's key under
// broker in config.yaml.
const Kind = "nats"

// Config is the broker.nats section of config.yaml.
type Config struct {
	// URL is the NATS server URL, or a comma-separated list of a cluster's
	// seed servers (the client also learns the others from the cluster and
	// fails over between them). NATS_URL overrides it. With
	// Embedded.Enabled it is the address the in-process server listens on
	// (port 0 picks a free one). Defaults to nats://127.0.0.1:4222.
	URL string `yaml:"url"`
	// PingInterval is how often the client pings a server that sends it
	// nothing; two unanswered pings mark the connection dead and it moves to
	// another server; a write to the server blocked for two intervals (a
	// server cut off the network, the socket's buffer full) does the same.
	// It bounds how long a hung (stopped, cut off) server holds up the
	// relay and consumers. Defaults to 5s (nats.go: 2m, and a blocked write
	// 1m).
	PingInterval time.Duration `yaml:"ping_interval"`
	// Stream configures the JetStream stream millrace creates for each topic.
	Stream StreamConfig `yaml:"stream"`
	// Consumer configures the durable consumer millrace creates for each
	// consumer group of a topic, and how subscribers read from it.
	Consumer ConsumerConfig `yaml:"consumer"`
	// Publish configures publishing, PublishBatch in particular.
	Publish PublishConfig `yaml:"publish"`
	// Embedded runs a nats-server with JetStream inside the process, for
	// tests and the demo on a machine without a NATS server.
	Embedded EmbeddedConfig `yaml:"embedded"`

	// User and Password authenticate with a user name and password (as
	// nats://user:password@host in the URL does; set them in one place).
	// Take the password from the environment or a mounted file
	// (${NATS_PASSWORD}, ${file:/run/secrets/nats}). Defaults to "".
	User string `yaml:"user"`
	// Password is User's password. Defaults to "".
	Password string `yaml:"password"`
	// Token authenticates with a server token. Defaults to "".
	Token string `yaml:"token"`
	// NKeySeedFile is a file holding the user's NKey seed ("SU..."); the
	// server knows the user by its public key. Defaults to "".
	NKeySeedFile string `yaml:"nkey_seed_file"`
	// CredsFile is a .creds file (user JWT and NKey seed) for servers in
	// operator (JWT) mode, such as NGS/Synadia Cloud. Defaults to "".
	CredsFile string `yaml:"creds_file"`
	// TLS encrypts and authenticates the connection; a tls:// URL turns it
	// on as well. Defaults to off.
	TLS adapters.TLSConfig `yaml:"tls"`
}

// StreamConfig is broker.nats.stream: the settings of every stream millrace
// provisions. Streams always use file storage, limits retention (every
// consumer group reads every message; a message leaves only by max_age or
// max_bytes) and discard-new (a full stream refuses new messages, which stay
// in the outbox and are retried, instead of silently dropping old ones).
type StreamConfig struct {
	// Replicas is the number of copies JetStream keeps of each message (1 to
	// 5; a cluster needs at least 3 for a copy to survive a node). Defaults to 1,
	// which suits a single server; use 3 on a production cluster.
	Replicas int `yaml:"replicas"`
	// MaxAge is how long a message is kept, consumed or not. Defaults to
	// 168h (7 days).
	MaxAge time.Duration `yaml:"max_age"`
	// MaxBytes caps a stream's size on disk; a full stream refuses new messages
	// (retryable for the relay). Defaults to 0: no cap beyond the server's.
	MaxBytes int64 `yaml:"max_bytes"`
	// DuplicateWindow is how long the server remembers event ids
	// (Nats-Msg-Id) to drop a message published again, as the relay does after
	// an unconfirmed batch. Defaults to 2m; it must not exceed max_age.
	DuplicateWindow time.Duration `yaml:"duplicate_window"`
	// MaxMsgSize is the largest message (payload plus headers) the stream
	// accepts, in bytes. Defaults to 0: the server's max_payload (1 MiB unless
	// the server raises it).
	MaxMsgSize int32 `yaml:"max_msg_size"`
}

// ConsumerConfig is broker.nats.consumer: the settings of the durable
// consumer of each consumer group and of the subscribers reading from it.
type ConsumerConfig struct {
	// AckWait is how long the server waits for a message's ack before it
	// delivers the message again. It must exceed the longest time a handler
	// (with its in-process retries) takes. Defaults to 60s.
	AckWait time.Duration `yaml:"ack_wait"`
	// MaxDeliver is how many times the server delivers a message to a group
	// before giving up on it; -1 means no limit. A message that reaches the
	// limit is skipped for the group (it stays in the stream), so millrace
	// relies on its poison queue instead; bus refuses a limit below an
	// unordered handler's retry.max_attempts, whose attempts are deliveries.
	// Defaults to -1.
	MaxDeliver int `yaml:"max_deliver"`
	// MaxAckPending is how many messages a group may hold delivered but not
	// acked, across all its subscriptions in all processes (its prefetch); the
	// server sends no more until some are acked. Messages wait in a busy
	// subscription's buffer with their ack_wait running, so keep it below
	// ack_wait divided by the slowest handler's time, and at least the number
	// of the group's subscriptions. 1 keeps strict order even across
	// redeliveries, but then the group handles one message at a time; the
	// group of a handler with consumer.ordered: true is set by its ordered
	// subscriber instead (an Ordered adapters.SubscriberSpec). Defaults to 32.
	MaxAckPending int `yaml:"max_ack_pending"`
	// NakDelay is how long the server waits before delivering a nacked
	// message again, so a failing message does not spin. Defaults to 5s.
	NakDelay time.Duration `yaml:"nak_delay"`
	// Subscribers is how many subscriptions (watermill-nats SubscribersCount)
	// each Subscribe call opens on the group's consumer; each holds one
	// message until it is acked or nacked, so it is how many messages of the
	// group one Subscribe call works on at once. The server gives each message
	// to a random subscription of the group. Order holds only with 1.
	// Defaults to 1.
	Subscribers int `yaml:"subscribers"`
	// LeaseTTL is how long an ordered group's lease outlives its holder's
	// last renewal: one process of the group at a time consumes an ordered
	// group (an Ordered adapters.SubscriberSpec), and when it dies another
	// takes the group over within LeaseTTL and one poll (LeaseTTL/4) of
	// seeing the lease unrenewed. Defaults to 5s.
	LeaseTTL time.Duration `yaml:"lease_ttl"`
}

// PublishConfig is broker.nats.publish.
type PublishConfig struct {
	// Timeout bounds the wait for the server's confirm of each message (and
	// the wait for room when max_pending messages are unconfirmed). Defaults
	// to 30s.
	Timeout time.Duration `yaml:"timeout"`
	// MaxPending is how many messages PublishBatch keeps sent but unconfirmed
	// at once. Defaults to 1024.
	MaxPending int `yaml:"max_pending"`
}

// EmbeddedConfig is broker.nats.embedded.
type EmbeddedConfig struct {
	// Enabled starts an in-process nats-server with JetStream, listening on
	// the host and port of broker.nats.url, for as long as the Broker is open.
	// Defaults to false.
	Enabled bool `yaml:"enabled"`
	// StoreDir is where the embedded server keeps its streams. Defaults to
	// millrace-nats in the system's temporary directory.
	StoreDir string `yaml:"store_dir"`
	// Sync is when the embedded server flushes stream files to disk: "always"
	// (fsync before confirming each message: a confirmed message survives a
	// power loss) or a duration such as "2m" (flush every interval: faster, but
	// a power loss or kernel crash may lose what was confirmed since the last
	// flush; a crash of the process alone loses nothing). Defaults to "always".
	Sync string `yaml:"sync"`
}

// SyncAlways is the EmbeddedConfig.Sync value that fsyncs every write.
const SyncAlways = embed.SyncAlways

// Defaults, one place.
const (
	defaultReplicas        = 1
	defaultMaxAge          = 7 * 24 * time.Hour
	defaultDuplicateWindow = 2 * time.Minute
	defaultAckWait         = 60 * time.Second
	defaultMaxDeliver      = -1
	defaultMaxAckPending   = 32
	defaultNakDelay        = 5 * time.Second
	defaultSubscribers     = 1
	defaultLeaseTTL        = 5 * time.Second
	defaultPublishTimeout  = 30 * time.Second
	defaultMaxPending      = 1024
	defaultPingInterval    = 5 * time.Second
)

// NatsdevPackage is the package that links the embedded server into a
// program when imported.
const NatsdevPackage = "github.com/millrace-io/millrace/adapters/nats/natsdev"

// DefaultURL is broker.nats.url's default: a local nats-server.
const DefaultURL = "nats://127.0.0.1:4222"

// DefaultStoreDir is broker.nats.embedded.store_dir's default.
func DefaultStoreDir() string { return embed.DefaultStoreDir() }

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.URL = cmp.Or(c.URL, DefaultURL)
	c.PingInterval = cmp.Or(c.PingInterval, defaultPingInterval)
	c.Stream.Replicas = cmp.Or(c.Stream.Replicas, defaultReplicas)
	c.Stream.MaxAge = cmp.Or(c.Stream.MaxAge, defaultMaxAge)
	c.Stream.DuplicateWindow = cmp.Or(c.Stream.DuplicateWindow, defaultDuplicateWindow)
	c.Consumer.AckWait = cmp.Or(c.Consumer.AckWait, defaultAckWait)
	c.Consumer.MaxDeliver = cmp.Or(c.Consumer.MaxDeliver, defaultMaxDeliver)
	c.Consumer.MaxAckPending = cmp.Or(c.Consumer.MaxAckPending, defaultMaxAckPending)
	c.Consumer.NakDelay = cmp.Or(c.Consumer.NakDelay, defaultNakDelay)
	c.Consumer.Subscribers = cmp.Or(c.Consumer.Subscribers, defaultSubscribers)
	c.Consumer.LeaseTTL = cmp.Or(c.Consumer.LeaseTTL, defaultLeaseTTL)
	c.Publish.Timeout = cmp.Or(c.Publish.Timeout, defaultPublishTimeout)
	c.Publish.MaxPending = cmp.Or(c.Publish.MaxPending, defaultMaxPending)
	c.Embedded.StoreDir = cmp.Or(c.Embedded.StoreDir, DefaultStoreDir())
	c.Embedded.Sync = cmp.Or(c.Embedded.Sync, SyncAlways)
	c.TLS = c.TLS.WithDefaults()
	return c
}

// Validate returns every problem in c, each naming its YAML path under path.
// Call it on a Config that has had WithDefaults applied.
func (c Config) Validate(path string) []error {
	var chk confload.Checker
	at := func(parts ...string) string {
		p := path
		for _, part := range parts {
			p = confload.Join(p, part)
		}
		return p
	}
	for _, u := range c.urls() {
		chk.URL(at("url"), u, "nats", "tls")
	}

	chk.PositiveDuration(at("ping_interval"), c.PingInterval)
	if c.Stream.Replicas < 1 || c.Stream.Replicas > 5 {
		chk.Add(at("stream", "replicas"), "must be between 1 and 5; got %d", c.Stream.Replicas)
	}
	chk.PositiveDuration(at("stream", "max_age"), c.Stream.MaxAge)
	if c.Stream.MaxBytes < 0 {
		chk.Add(at("stream", "max_bytes"), "must not be negative (0 means no cap); got %d", c.Stream.MaxBytes)
	}
	chk.PositiveDuration(at("stream", "duplicate_window"), c.Stream.DuplicateWindow)
	if c.Stream.DuplicateWindow > c.Stream.MaxAge && c.Stream.MaxAge > 0 {
		chk.Add(at("stream", "duplicate_window"), "must not exceed stream.max_age (%s); got %s", c.Stream.MaxAge, c.Stream.DuplicateWindow)
	}
	if c.Stream.MaxMsgSize < 0 {
		chk.Add(at("stream", "max_msg_size"), "must not be negative (0 means the server's max_payload); got %d", c.Stream.MaxMsgSize)
	}

	chk.PositiveDuration(at("consumer", "ack_wait"), c.Consumer.AckWait)
	if c.Consumer.MaxDeliver < 1 && c.Consumer.MaxDeliver != -1 {
		chk.Add(at("consumer", "max_deliver"), "must be -1 (no limit) or at least 1; got %d", c.Consumer.MaxDeliver)
	}
	chk.Positive(at("consumer", "max_ack_pending"), c.Consumer.MaxAckPending)
	chk.PositiveDuration(at("consumer", "nak_delay"), c.Consumer.NakDelay)
	chk.Positive(at("consumer", "subscribers"), c.Consumer.Subscribers)
	chk.PositiveDuration(at("consumer", "lease_ttl"), c.Consumer.LeaseTTL)

	chk.PositiveDuration(at("publish", "timeout"), c.Publish.Timeout)
	chk.Positive(at("publish", "max_pending"), c.Publish.MaxPending)

	if c.Embedded.Enabled {
		if !embed.Starter.Linked() {
			chk.Add(at("embedded", "enabled"), "%s: import _ %q in a development or test program to run it, or set it to false and point %s at a nats-server",
				embed.ErrNotLinked, NatsdevPackage, at("url"))
		}
		if c.Embedded.StoreDir == "" {
			chk.Add(at("embedded", "store_dir"), "required when embedded.enabled is true")
		}
		if len(c.urls()) > 1 {
			chk.Add(at("url"), "the embedded server listens on one URL, not a list")
		} else if _, _, err := embed.ListenAddr(c.URL); err != nil && c.URL != "" {
			chk.Add(at("url"), "the embedded server listens on this URL: %v", err)
		}
	}
	if _, err := embed.ParseSync(c.Embedded.Sync); err != nil {
		chk.Add(at("embedded", "sync"), "%v", err)
	}
	c.validateSecurity(&chk, path)
	return chk.Problems
}

// urls splits URL into its servers.
func (c Config) urls() []string { return adapterkit.SplitURLs(c.URL) }

// tlsOn reports whether connections use TLS: tls.enabled or a tls:// URL.
func (c Config) tlsOn() bool {
	for _, raw := range c.urls() {
		if u, err := url.Parse(raw); err == nil && u.Scheme == "tls" {
			return true
		}
	}
	return c.TLS.Enabled
}

// authMethods lists the credentials configured, by YAML key.
func (c Config) authMethods() []string {
	var m []string
	for _, raw := range c.urls() {
		if u, err := url.Parse(raw); err == nil && u.User != nil {
			m = append(m, "url")
			break
		}
	}
	if c.User != "" || c.Password != "" {
		m = append(m, "user")
	}
	if c.Token != "" {
		m = append(m, "token")
	}
	if c.NKeySeedFile != "" {
		m = append(m, "nkey_seed_file")
	}
	if c.CredsFile != "" {
		m = append(m, "creds_file")
	}
	return m
}

func (c Config) validateSecurity(chk *confload.Checker, path string) {
	at := func(key string) string { return confload.Join(path, key) }
	chk.Merge(c.TLS.Validate(at("tls"), c.tlsOn()))
	if methods := c.authMethods(); len(methods) > 1 {
		chk.Add(at(methods[1]), "only one way to authenticate may be set; got %s", strings.Join(methods, " and "))
	}
	if c.Password != "" && c.User == "" {
		chk.Add(at("user"), "required with password")
	}
	if c.User != "" && c.Password == "" {
		chk.Add(at("password"), "required with user")
	}
	if c.NKeySeedFile != "" {
		// Reads and checks the seed now, so a bad file is reported at load time.
		if _, err := nats.NkeyOptionFromSeed(c.NKeySeedFile); err != nil {
			chk.Add(at("nkey_seed_file"), "cannot use %s: %s", c.NKeySeedFile, fileProblem(err))
		}
	}
	if c.CredsFile != "" {
		if err := checkCreds(c.CredsFile); err != nil {
			chk.Add(at("creds_file"), "cannot use %s: %v", c.CredsFile, err)
		}
	}
	if c.Embedded.Enabled {
		for _, key := range []string{"user", "token", "nkey_seed_file", "creds_file"} {
			if slices.Contains(c.authMethods(), key) {
				chk.Add(at(key), "the embedded server takes credentials from url (nats://user:password@host:port) only")
			}
		}
		if c.tlsOn() {
			chk.Add(at("tls"), "the embedded server does not serve TLS; turn tls off with embedded.enabled: true")
		}
	}
}

// fileProblem is err's text without any path-independent detail that could
// echo a file's contents (nats.go's messages never do; this keeps it so).
func fileProblem(err error) string {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}

// checkCreds checks that path is a .creds file: a user JWT and an NKey seed.
func checkCreds(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return errors.Unwrap(err)
	}
	token, err := jwt.ParseDecoratedJWT(data)
	if err == nil {
		_, err = jwt.DecodeUserClaims(token)
	}
	if err != nil {
		return errors.New("no user JWT in it (a .creds file holds a NATS USER JWT block and a USER NKEY SEED block)")
	}
	kp, err := jwt.ParseDecoratedNKey(data)
	if err != nil {
		return errors.New("no user NKey seed in it (a .creds file holds a NATS USER JWT block and a USER NKEY SEED block)")
	}
	kp.Wipe()
	return nil
}
