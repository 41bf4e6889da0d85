package rabbit

import (
	"cmp"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/internal/adapterkit"
	"github.com/millrace-io/millrace/internal/confload"
)

// Kind is the broker.kind of this adapter, and its section's key under
// broker in config.yaml.
const Kind = "rabbitmq"

// DefaultURL is broker.rabbitmq.url's default: a local server, with
// RabbitMQ's default credentials (guest/guest) as amqp091 fills them in.
const DefaultURL = "amqp://127.0.0.1:5672/"

// DefaultMaxMessageBytes is max_message_bytes' default: RabbitMQ's own
// max_message_size default (128 MiB) since 3.8.
const DefaultMaxMessageBytes = 128 << 20

// maxMessageBytesCeiling is the largest max_message_size RabbitMQ accepts (512 MiB).
const maxMessageBytesCeiling = 512 << 20

// Config is the broker.rabbitmq section of config.yaml.
type Config struct {
	// URL is the AMQP URL, or a comma-separated list of a cluster's nodes
	// (connections go to the first that answers, the next on a failure).
	// AMQP_URL overrides it. Defaults to
	// amqp://127.0.0.1:5672/ (a local server, as guest/guest, which RabbitMQ
	// allows from localhost only).
	URL string `yaml:"url"`

	// Prefetch is how many unacknowledged deliveries RabbitMQ hands one
	// subscription at a time (basic.qos prefetch-count, per consumer).
	// Defaults to 1: a subscription processes one message at a time anyway,
	// and with 1 a nacked message is redelivered before any later one, so a
	// queue with a single consumer keeps its order even across redeliveries.
	// Raise it for throughput when handlers tolerate reordering after a Nack.
	Prefetch int `yaml:"prefetch"`

	// DeliveryLimit is the quorum queues' x-delivery-limit: after this many
	// redeliveries (Nack, a consumer crash or a closed channel) RabbitMQ
	// dead-letters the message into its group's dead-letter queue instead of
	// delivering it again, so a message that crashes its consumer cannot stall
	// the queue forever. Defaults to 20.
	DeliveryLimit int `yaml:"delivery_limit"`

	// MaxMessageBytes is the largest message body published. A larger one is
	// refused before it is sent with a permanent error naming this limit; the
	// rest of its batch still goes out. Keep it at or below the server's
	// max_message_size: a body over that makes RabbitMQ close the channel and
	// fail everything in flight on it. Defaults to 134217728 (128 MiB, the
	// server's default max_message_size).
	MaxMessageBytes int `yaml:"max_message_bytes"`

	// Heartbeat is the AMQP heartbeat interval: how soon a silently dead
	// connection is noticed (after about two missed beats). A heartbeat in
	// the URL (?heartbeat=N) takes precedence. At least 1s. Defaults to 10s.
	Heartbeat time.Duration `yaml:"heartbeat"`

	// ReconnectMaxInterval caps the backoff between a subscriber's attempts
	// to reconnect after it lost its connection (a broker restart): it starts
	// at 100ms and grows to this. Publishing reconnects on its next call.
	// Defaults to 5s.
	ReconnectMaxInterval time.Duration `yaml:"reconnect_max_interval"`

	// User and Password are the credentials (SASL PLAIN), so that the URL
	// can stay free of secrets; take the password from the environment or a
	// mounted file (${AMQP_PASSWORD}, ${file:/run/secrets/amqp}). Set them
	// here or in the URL, not both. Defaults to "": the URL's, or guest/guest
	// when the URL has none.
	User string `yaml:"user"`
	// Password is User's password. Defaults to "".
	Password string `yaml:"password"`

	// TLS configures the connection of an amqps:// URL (which turns TLS on:
	// RabbitMQ serves TLS on its own port, 5671 by convention). Defaults to
	// the system's roots and TLS 1.2 or newer.
	TLS adapters.TLSConfig `yaml:"tls"`
}

// urlTLSParams are amqp091's TLS settings in the URL's query.
var urlTLSParams = []string{"cacertfile", "certfile", "keyfile", "server_name_indication"}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.URL = cmp.Or(c.URL, DefaultURL)
	c.Prefetch = cmp.Or(c.Prefetch, 1)
	c.DeliveryLimit = cmp.Or(c.DeliveryLimit, 20)
	c.MaxMessageBytes = cmp.Or(c.MaxMessageBytes, DefaultMaxMessageBytes)
	c.Heartbeat = cmp.Or(c.Heartbeat, 10*time.Second)
	c.ReconnectMaxInterval = cmp.Or(c.ReconnectMaxInterval, 5*time.Second)
	c.TLS = c.TLS.WithDefaults()
	return c
}

// Validate returns every problem in c, each naming its YAML path under path.
// Call it on a Config that has had WithDefaults applied.
func (c Config) Validate(path string) []error {
	var chk confload.Checker
	urls := c.urls()
	for _, u := range urls {
		chk.URL(confload.Join(path, "url"), u, "amqp", "amqps")
	}
	for _, u := range urls[1:] {
		amqpScheme := func(s string) bool { return s == "amqp" || s == "amqps" } // others are reported above
		if a, b := scheme(urls[0]), scheme(u); a != b && amqpScheme(a) && amqpScheme(b) {
			chk.Add(confload.Join(path, "url"), "every node of the list uses one scheme; got %s:// and %s://", a, b)
			break
		}
	}
	chk.Positive(confload.Join(path, "prefetch"), c.Prefetch)
	if c.Prefetch > 65535 {
		chk.Add(confload.Join(path, "prefetch"), "must be at most 65535 (an AMQP short); got %d", c.Prefetch)
	}
	chk.Positive(confload.Join(path, "delivery_limit"), c.DeliveryLimit)
	chk.Positive(confload.Join(path, "max_message_bytes"), c.MaxMessageBytes)
	if c.MaxMessageBytes > maxMessageBytesCeiling {
		chk.Add(confload.Join(path, "max_message_bytes"),
			"must be at most %d (RabbitMQ's largest max_message_size); got %d", maxMessageBytesCeiling, c.MaxMessageBytes)
	}
	if c.Heartbeat < time.Second {
		chk.Add(confload.Join(path, "heartbeat"), "must be at least 1s (AMQP counts heartbeats in whole seconds); got %s", c.Heartbeat)
	}
	chk.PositiveDuration(confload.Join(path, "reconnect_max_interval"), c.ReconnectMaxInterval)
	c.validateSecurity(&chk, path)
	return chk.Problems
}

// urls splits URL into its nodes.
func (c Config) urls() []string { return adapterkit.SplitURLs(c.URL) }

// scheme is rawURL's scheme, or "" when it does not parse.
func scheme(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return ""
	}
	return u.Scheme
}

// tlsOn reports whether the URL is amqps:// (Validate checks that every
// node of a list uses one scheme).
func (c Config) tlsOn() bool { return scheme(c.urls()[0]) == "amqps" }

// urlTLS lists the TLS settings the URLs' queries carry.
func (c Config) urlTLS() []string {
	var set []string
	for _, raw := range c.urls() {
		u, err := url.Parse(raw)
		if err != nil {
			continue
		}
		for _, p := range urlTLSParams {
			if u.Query().Has(p) && !slices.Contains(set, p) {
				set = append(set, p)
			}
		}
	}
	return set
}

// urlCredentials reports whether any URL of the list carries credentials.
func (c Config) urlCredentials() bool {
	for _, raw := range c.urls() {
		if u, err := url.Parse(raw); err == nil && u.User != nil {
			return true
		}
	}
	return false
}

func (c Config) validateSecurity(chk *confload.Checker, path string) {
	at := func(key string) string { return confload.Join(path, key) }
	if c.TLS.Enabled && !c.tlsOn() {
		chk.Add(at("url"), "tls.enabled is true but the URL is not amqps:// (RabbitMQ serves TLS on its own port, 5671 by convention)")
	}
	if params := c.urlTLS(); len(params) > 0 && c.TLS.Customized() {
		chk.Add(at("tls"), "TLS is set both here and in the URL (%s); set it in one place", strings.Join(params, ", "))
	}
	chk.Merge(c.TLS.Validate(at("tls"), c.tlsOn()))
	if c.urlCredentials() && (c.User != "" || c.Password != "") {
		chk.Add(at("user"), "the URL has credentials too; set them in one place")
	}
	if c.Password != "" && c.User == "" {
		chk.Add(at("user"), "required with password")
	}
	if c.User != "" && c.Password == "" {
		chk.Add(at("password"), "required with user")
	}
}
