package rabbit

import (
	"cmp"
	"net/url"
	"strings"
	"time"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/confload"
)

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
	// URL is the AMQP URL. AMQP_URL overrides it. Defaults to
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
	chk.URL(confload.Join(path, "url"), c.URL, "amqp", "amqps")
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

// tlsOn reports whether the URL is amqps://.
func (c Config) tlsOn() bool {
	u, err := url.Parse(c.URL)
	return err == nil && u.Scheme == "amqps"
}

// urlTLS lists the TLS settings the URL's query carries.
func (c Config) urlTLS() []string {
	u, err := url.Parse(c.URL)
	if err != nil {
		return nil
	}
	var set []string
	for _, p := range urlTLSParams {
		if u.Query().Has(p) {
			set = append(set, p)
		}
	}
	return set
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
	if u, err := url.Parse(c.URL); err == nil && u.User != nil && (c.User != "" || c.Password != "") {
		chk.Add(at("user"), "the URL has credentials too; set them in one place")
	}
	if c.Password != "" && c.User == "" {
		chk.Add(at("user"), "required with password")
	}
	if c.User != "" && c.Password == "" {
		chk.Add(at("password"), "required with user")
	}
}
