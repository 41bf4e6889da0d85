package bus

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/adapters/rabbit"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/middleware"
)

// Broker kinds accepted by broker.kind.
const (
	KindKafka    = kafka.Kind
	KindRabbitMQ = rabbit.Kind
	KindNATS     = nats.Kind
)

// Payload codecs accepted by outbox.codec.
const (
	// CodecJSON requires every payload to be one valid JSON value.
	CodecJSON = "json"
	// CodecBytes accepts any bytes (protobuf, Avro, ...).
	CodecBytes = "bytes"
)

// Values of outbox.mode.
const (
	// OutboxModeTable writes each event as a row of the outbox table.
	OutboxModeTable = "table"
	// OutboxModeWALMessages writes each event as a transactional logical
	// message (pg_logical_emit_message) in the caller's transaction, which
	// only the WAL relay (relay.source: wal) reads: no outbox row, index,
	// cleanup or vacuum.
	OutboxModeWALMessages = "wal_messages"
)

// Config is millrace's whole configuration. It maps one to one onto config.yaml;
// each field's comment gives its YAML key's default.
type Config struct {
	// Database is where the outbox, offsets and inbox tables live.
	Database DatabaseConfig `yaml:"database"`
	// Outbox controls what Publish accepts and where it writes.
	Outbox OutboxConfig `yaml:"outbox"`
	// Broker selects and configures the message broker.
	Broker BrokerConfig `yaml:"broker"`
	// Relay configures the relay from the outbox to the broker.
	Relay forwarder.Config `yaml:"relay"`
	// Metrics configures the Prometheus endpoint.
	Metrics MetricsConfig `yaml:"metrics"`
	// Health configures the liveness and readiness checks.
	Health HealthConfig `yaml:"health"`
	// Consumer configures the consumer middleware chain (retry, poison
	// queue, circuit breaker, inbox, concurrency), with per-handler overrides
	// under consumer.handlers.<name>.
	Consumer middleware.Config `yaml:"consumer"`

	// envSources maps a YAML path to the environment variable that overrode it.
	envSources map[string]string
	// valid is the config as LoadConfig or ParseConfig validated it, so
	// Open, Migrate and ops.New do not check it (and read its TLS files)
	// again unless it changed since.
	valid *Config
}

// check applies c's defaults and validates it, unless LoadConfig already
// validated exactly this config: the one check of a start.
func (c Config) check() (Config, error) { return c.checkFor(true) }

// checkFor is check, leaving the broker section out unless broker: for
// what needs only the database (Migrate, ValidateDatabase).
func (c Config) checkFor(broker bool) (Config, error) {
	c = c.WithDefaults()
	if c.valid != nil {
		checked := c
		checked.valid = nil
		if reflect.DeepEqual(checked, *c.valid) {
			return c, nil
		}
	}
	return c, c.validate(broker)
}

// ValidateDatabase applies c's defaults and validates all but the broker
// section: the check of what needs only the database (Migrate, the ops
// package). A config LoadConfig or ParseConfig validated, unchanged since,
// is not checked again.
func (c Config) ValidateDatabase() error {
	_, err := c.checkFor(false)
	return err
}

// DatabaseConfig is the database section.
type DatabaseConfig struct {
	// URL is the PostgreSQL URL used when Open is given no *sql.DB and by the
	// command-line tool. Defaults to
	// postgres://postgres:postgres@127.0.0.1:5432/postgres?sslmode=disable.
	// DATABASE_URL overrides it. TLS is set by its libpq parameters, which
	// pgx implements: sslmode (checked: disable, allow, prefer, require,
	// verify-ca or verify-full; use verify-full in production), sslrootcert
	// (a CA file, or "system"), sslcert and sslkey (checked readable),
	// sslpassword. Errors and logs show it without its password.
	URL string `yaml:"url"`
	// DirectURL reaches the same database without a pooler in transaction
	// mode between (PgBouncer, RDS Proxy), when URL goes through one. The
	// relay LISTENs on it, to wake at each commit and to tie its lease to a
	// session (a standby takes over at once when the active relay's process
	// dies); nothing else uses it. Without it, a relay whose URL is pooled
	// finds that notifications do not reach it and polls every
	// relay.poll_interval. Defaults to none (the relay LISTENs on URL).
	// DATABASE_DIRECT_URL overrides it.
	DirectURL string `yaml:"direct_url"`
	// Schema is the PostgreSQL schema holding millrace's tables. Defaults to "public".
	Schema string `yaml:"schema"`
	// ConnectTimeout bounds the first connection check in Open. Defaults to 5s.
	ConnectTimeout time.Duration `yaml:"connect_timeout"`
}

// OutboxConfig is the outbox section.
type OutboxConfig struct {
	// Topic is the watermill-sql topic of the outbox; the table is
	// "watermill_<topic>", the same name Watermill's forwarder.Publisher with
	// ForwarderTopic=<topic> writes to. Defaults to "millrace_outbox".
	Topic string `yaml:"topic"`
	// Codec is how the payloads of events without a ContentType are checked
	// and labelled: "json" (valid JSON, application/json) or "bytes"
	// (anything, application/octet-stream). An event's own ContentType (a
	// typed topic's codec sets it) takes precedence. Defaults to "json".
	Codec string `yaml:"codec"`
	// MaxPayloadBytes is the largest payload Publish accepts. Defaults to
	// 1000000, under the 1 MiB message limit of Kafka and NATS with room for headers.
	MaxPayloadBytes int `yaml:"max_payload_bytes"`
	// MaxMetadataBytes is the largest total size of an event's metadata keys
	// and values. Defaults to 16384.
	MaxMetadataBytes int `yaml:"max_metadata_bytes"`
	// CloudEvents also writes every event's CloudEvents binary-mode
	// attributes as broker headers.
	CloudEvents CloudEventsConfig `yaml:"cloudevents"`
	// Mode is how Publish writes events: "table" (a row of the outbox table
	// each) or "wal_messages" (a transactional logical message each,
	// pg_logical_emit_message, read by relay.source: wal only, which it
	// requires; the relay's slot must exist before the first Publish, and
	// Open creates it when missing). Scheduled events keep their table
	// and reach the outbox table when due. See docs/WAL.md. Defaults to
	// "table".
	Mode string `yaml:"mode"`
}

// CloudEventsConfig is the outbox.cloudevents section: with it on, a
// CloudEvents consumer (Dapr, Knative, a CloudEvents SDK) reads millrace's
// events in binary content mode without millrace. The attributes are
// headers with the prefix of the broker's CloudEvents binding: ce_ on Kafka,
// ce- on NATS, cloudEvents_ on RabbitMQ (the AMQP binding); content-type is
// datacontenttype, as the bindings have it.
type CloudEventsConfig struct {
	// Enabled writes id (the event id), type (the event type), source,
	// specversion ("1.0") and time (occurred-at). Metadata keys with the
	// broker's prefix are then refused at Publish. Defaults to false.
	Enabled bool `yaml:"enabled"`
	// Source is the source attribute, a URI reference naming the producing
	// service, e.g. "/services/orders" or "urn:example:orders". Required when
	// Enabled.
	Source string `yaml:"source"`
}

// BrokerConfig is the broker section.
type BrokerConfig struct {
	// Kind selects the broker: kafka, rabbitmq or nats. Defaults to "nats".
	// MILLRACE_BROKER_KIND overrides it.
	Kind string `yaml:"kind"`
	// ConnectTimeout bounds connecting to the broker at start. Defaults to 10s.
	ConnectTimeout time.Duration `yaml:"connect_timeout"`
	// Kafka configures broker.kind: kafka.
	Kafka kafka.Config `yaml:"kafka"`
	// RabbitMQ configures broker.kind: rabbitmq.
	RabbitMQ rabbit.Config `yaml:"rabbitmq"`
	// NATS configures broker.kind: nats.
	NATS nats.Config `yaml:"nats"`
}

// MetricsConfig is the metrics section.
type MetricsConfig struct {
	// Listen is the address (host:port) where Run serves the relay and
	// consumer metrics at /metrics; empty serves nothing (mount
	// Bus.MetricsHandler yourself). Run serves the health endpoints
	// /livez, /readyz and /healthz there too. Defaults to "".
	Listen string `yaml:"listen"`
	// InboxRowsInterval is how often Run counts the inbox rows of each
	// consumer group for millrace_inbox_rows (one index-only scan of the
	// inbox table). Defaults to 30s.
	InboxRowsInterval time.Duration `yaml:"inbox_rows_interval"`
	// BacklogInterval is how often Run asks the broker for each handler's
	// backlog for millrace_consumer_backlog. Defaults to 15s.
	BacklogInterval time.Duration `yaml:"backlog_interval"`
}

// HealthConfig is the health section.
type HealthConfig struct {
	// StallTimeout is how long the relay loop, or a handler with messages
	// in its chain, may go without moving on before liveness fails (the
	// process is wedged). A relay standing by for the lease, and a
	// handler with nothing to do, are live however long they wait. Must
	// exceed relay.poll_interval and relay.retry_max, and each handler's
	// handler_timeout plus the longer of its retry.max_interval and
	// breaker.open_timeout. Defaults to 5m.
	StallTimeout time.Duration `yaml:"stall_timeout"`
	// CheckTimeout bounds each readiness probe (database, broker).
	// Defaults to 2s.
	CheckTimeout time.Duration `yaml:"check_timeout"`
}

// DefaultDatabaseURL is database.url's default: the local PostgreSQL that
// `make up` provides.
const DefaultDatabaseURL = "postgres://postgres:postgres@127.0.0.1:5432/postgres?sslmode=disable"

// WithDefaults returns c with every unset field at its default. It is the one
// place defaults live; Open applies it, so a Config built in code needs only
// the fields it changes.
func (c Config) WithDefaults() Config {
	c.Database.URL = cmp.Or(c.Database.URL, DefaultDatabaseURL)
	c.Database.Schema = cmp.Or(c.Database.Schema, "public")
	c.Database.ConnectTimeout = cmp.Or(c.Database.ConnectTimeout, 5*time.Second)

	c.Outbox.Topic = cmp.Or(c.Outbox.Topic, "millrace_outbox")
	c.Outbox.Codec = cmp.Or(c.Outbox.Codec, CodecJSON)
	c.Outbox.Mode = cmp.Or(c.Outbox.Mode, OutboxModeTable)
	c.Outbox.MaxPayloadBytes = cmp.Or(c.Outbox.MaxPayloadBytes, 1_000_000)
	c.Outbox.MaxMetadataBytes = cmp.Or(c.Outbox.MaxMetadataBytes, 16_384)

	c.Broker.Kind = cmp.Or(c.Broker.Kind, KindNATS)
	c.Broker.ConnectTimeout = cmp.Or(c.Broker.ConnectTimeout, 10*time.Second)
	c.Broker.Kafka = c.Broker.Kafka.WithDefaults()
	c.Broker.RabbitMQ = c.Broker.RabbitMQ.WithDefaults()
	c.Broker.NATS = c.Broker.NATS.WithDefaults()
	c.Relay = c.Relay.WithDefaults()
	c.Consumer = c.Consumer.WithDefaults()
	c.Metrics.InboxRowsInterval = cmp.Or(c.Metrics.InboxRowsInterval, 30*time.Second)
	c.Metrics.BacklogInterval = cmp.Or(c.Metrics.BacklogInterval, 15*time.Second)
	c.Health.StallTimeout = cmp.Or(c.Health.StallTimeout, 5*time.Minute)
	c.Health.CheckTimeout = cmp.Or(c.Health.CheckTimeout, 2*time.Second)
	return c
}

// Validate reports every problem in c at once as a *ConfigError whose
// problems each name their YAML path. Call it on a Config that has had
// WithDefaults applied (LoadConfig and Open do).
func (c Config) Validate() error { return c.validate(true) }

// validate is Validate, leaving the broker section out unless broker.
func (c Config) validate(broker bool) error {
	var chk confload.Checker
	chk.URL("database.url", c.Database.URL, "postgres", "postgresql")
	checkDatabaseTLS(&chk, "database.url", c.Database.URL)
	if c.Database.DirectURL != "" {
		chk.URL("database.direct_url", c.Database.DirectURL, "postgres", "postgresql")
		checkDatabaseTLS(&chk, "database.direct_url", c.Database.DirectURL)
	}
	chk.Check("database.schema", names.Schema(c.Database.Schema, store.MaxIdentifierLength))
	chk.PositiveDuration("database.connect_timeout", c.Database.ConnectTimeout)

	// "watermill_offsets_" + topic must fit PostgreSQL's 63-byte identifiers.
	chk.Check("outbox.topic", names.Identifier(c.Outbox.Topic, store.MaxOutboxTopicLength))
	chk.OneOf("outbox.codec", c.Outbox.Codec, CodecJSON, CodecBytes)
	chk.OneOf("outbox.mode", c.Outbox.Mode, OutboxModeTable, OutboxModeWALMessages)
	if c.Outbox.Mode == OutboxModeWALMessages && c.Relay.Source != forwarder.SourceWAL {
		chk.Add("outbox.mode", "wal_messages is read only by the WAL relay and needs relay.source: wal; got relay.source: %q", c.Relay.Source)
	}
	chk.Positive("outbox.max_payload_bytes", c.Outbox.MaxPayloadBytes)
	chk.Positive("outbox.max_metadata_bytes", c.Outbox.MaxMetadataBytes)
	if ce := c.Outbox.CloudEvents; ce.Enabled {
		if ce.Source == "" {
			chk.Add("outbox.cloudevents.source", "required when outbox.cloudevents.enabled is true: a URI reference naming this service, such as \"/services/orders\"")
		} else if _, err := url.Parse(ce.Source); err != nil || names.Text(ce.Source) != nil || strings.ContainsAny(ce.Source, " ") {
			chk.Add("outbox.cloudevents.source", "must be a URI reference, such as \"/services/orders\"; got %q", ce.Source)
		}
	} else if ce.Source != "" {
		chk.Add("outbox.cloudevents.source", "set while outbox.cloudevents.enabled is false: turn it on, or remove the source")
	}

	if broker {
		chk.OneOf("broker.kind", c.Broker.Kind, c.Broker.kinds()...)
		chk.PositiveDuration("broker.connect_timeout", c.Broker.ConnectTimeout)
		if path, section := c.Broker.section(); section != nil {
			chk.Merge(section.Validate(path))
		}
	}
	chk.Merge(c.Relay.Validate("relay"))
	if c.Metrics.Listen != "" && !validListen(c.Metrics.Listen) {
		chk.Add("metrics.listen", "must be host:port such as \":9464\" or \"127.0.0.1:9464\"; got %q", c.Metrics.Listen)
	}
	chk.PositiveDuration("metrics.inbox_rows_interval", c.Metrics.InboxRowsInterval)
	chk.PositiveDuration("metrics.backlog_interval", c.Metrics.BacklogInterval)
	chk.Merge(c.Consumer.Validate("consumer"))
	if path, section := c.Broker.section(); broker && section != nil {
		chk.Merge(section.ValidateConsumers(path, c.consumerSettings()))
	}
	c.validateHealth(&chk)
	if len(chk.Problems) == 0 {
		return nil
	}
	return &ConfigError{Problems: c.annotate(chk.Problems)}
}

// consumerSettings are the consumer section's settings and each handler
// override's, in that order and by name, as the broker's section checks
// them: the start set at each path, and the retries of the handler the
// override makes.
func (c Config) consumerSettings() []adapters.ConsumerSettings {
	settings := []adapters.ConsumerSettings{c.consumerSettingsOf("consumer", c.Consumer, c.Consumer.Start)}
	for _, name := range slices.Sorted(maps.Keys(c.Consumer.Handlers)) {
		settings = append(settings, c.consumerSettingsOf("consumer.handlers."+name, c.Consumer.For(name), c.Consumer.Handlers[name].Start))
	}
	return settings
}

// consumerSettingsOf is the settings of handler h at path, where start is
// set.
func (c Config) consumerSettingsOf(path string, h middleware.Config, start adapters.Start) adapters.ConsumerSettings {
	return adapters.ConsumerSettings{
		Path:             path,
		Start:            start,
		ScheduledRetries: (h.Ordered == nil || !*h.Ordered) && h.Retry.Mode != middleware.RetryInProcess,
		MaxAttempts:      h.Retry.MaxAttempts,
	}
}

// validateHealth checks the health section against the longest quiet
// spell of each loop it watches: a stall timeout shorter than that would
// fail liveness on a healthy process.
func (c Config) validateHealth(chk *confload.Checker) {
	chk.PositiveDuration("health.check_timeout", c.Health.CheckTimeout)
	if c.Health.StallTimeout <= 0 {
		chk.PositiveDuration("health.stall_timeout", c.Health.StallTimeout)
		return
	}
	stall := c.Health.StallTimeout
	for _, quiet := range []struct {
		path string
		d    time.Duration
	}{{"relay.poll_interval", c.Relay.PollInterval}, {"relay.retry_max", c.Relay.RetryMax}} {
		if quiet.d >= stall {
			chk.Add("health.stall_timeout", "must exceed %s (%s); got %s", quiet.path, quiet.d, stall)
		}
	}
	handlers := []string{""}
	for name := range c.Consumer.Handlers {
		handlers = append(handlers, name)
	}
	slices.Sort(handlers)
	for _, name := range handlers {
		h, path := c.Consumer, "consumer"
		if name != "" {
			h, path = c.Consumer.For(name), "consumer.handlers."+name
		}
		if quiet := handlerQuiet(h); quiet >= stall {
			chk.Add("health.stall_timeout", "must exceed %s.handler_timeout plus the longer of retry.max_interval and breaker.open_timeout (%s); got %s",
				path, quiet, stall)
		}
	}
}

// handlerQuiet is the longest a handler's chain goes without calling or
// returning from the handler while it holds a message: an attempt
// abandoned at handler_timeout, then a retry wait or an open breaker.
func handlerQuiet(h middleware.Config) time.Duration {
	return h.HandlerTimeout + max(h.Retry.MaxInterval, h.Breaker.OpenTimeout)
}

// SSL modes accepted in database.url's sslmode parameter (libpq's, which
// pgx implements). verify-full is the one that proves the server is the
// one named in the URL; require encrypts without checking who answers.
var sslModes = []string{"disable", "allow", "prefer", "require", "verify-ca", "verify-full"}

// checkDatabaseTLS checks the TLS parameters of the database URL raw at
// key: pgx does the TLS, but a mistyped sslmode or a missing certificate
// file should be a config error naming the key, not a failure at the first
// connection.
func checkDatabaseTLS(chk *confload.Checker, key, raw string) {
	u, err := url.Parse(raw)
	if err != nil {
		return // reported by chk.URL
	}
	q := u.Query()
	if mode := q.Get("sslmode"); q.Has("sslmode") && !slices.Contains(sslModes, mode) {
		chk.Add(key, "sslmode must be one of %s; got %q", strings.Join(sslModes, ", "), mode)
	}
	if root := q.Get("sslrootcert"); root != "" && root != "system" {
		checkReadable(chk, key, "sslrootcert", root)
	}
	cert, certKey := q.Get("sslcert"), q.Get("sslkey")
	if (cert == "") != (certKey == "") {
		chk.Add(key, "sslcert and sslkey go together (a client certificate needs its key)")
	}
	if cert != "" {
		checkReadable(chk, key, "sslcert", cert)
	}
	if certKey != "" {
		checkReadable(chk, key, "sslkey", certKey)
	}
}

func checkReadable(chk *confload.Checker, key, param, path string) {
	f, err := os.Open(path)
	if err != nil {
		chk.Add(key, "%s %s cannot be read: %v", param, path, errors.Unwrap(err))
		return
	}
	_ = f.Close()
}

var hostnamePattern = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$`)

// validListen reports whether addr is host:port with an empty host, an IP
// or a host name, and a numeric port.
func validListen(addr string) bool {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return false
	}
	return host == "" || net.ParseIP(host) != nil || hostnamePattern.MatchString(host)
}

// annotate names the environment variable behind a problem's value.
func (c Config) annotate(problems []error) []error {
	for _, p := range problems {
		if fe, ok := p.(*FieldError); ok {
			for path, env := range c.envSources {
				if fe.Path == path || strings.HasPrefix(fe.Path, path+"[") {
					fe.Problem += fmt.Sprintf(" (value from $%s)", env)
				}
			}
		}
	}
	return problems
}

// FieldError is one configuration problem and the YAML path it belongs to.
type FieldError = confload.FieldError

// ConfigError lists every problem found in a configuration.
type ConfigError struct {
	// Source is the file the configuration came from, if any.
	Source string
	// Problems are *FieldError values, in the order found.
	Problems []error
}

func (e *ConfigError) Error() string {
	var b strings.Builder
	b.WriteString("invalid millrace config")
	if e.Source != "" {
		b.WriteString(" " + e.Source)
	}
	fmt.Fprintf(&b, " (%d problem", len(e.Problems))
	if len(e.Problems) != 1 {
		b.WriteString("s")
	}
	b.WriteString("):")
	for _, p := range e.Problems {
		b.WriteString("\n  " + p.Error())
	}
	return b.String()
}

// Unwrap returns the individual problems, for errors.As.
func (e *ConfigError) Unwrap() []error { return e.Problems }

// envOverrides are the environment variables that replace a config value when set.
var envOverrides = []struct {
	env, path string
	apply     func(c *Config, v string)
}{
	{"DATABASE_URL", "database.url", func(c *Config, v string) { c.Database.URL = v }},
	{"DATABASE_DIRECT_URL", "database.direct_url", func(c *Config, v string) { c.Database.DirectURL = v }},
	{"MILLRACE_BROKER_KIND", "broker.kind", func(c *Config, v string) { c.Broker.Kind = v }},
	{"KAFKA_BROKERS", "broker.kafka.brokers", func(c *Config, v string) { c.Broker.Kafka.Brokers = splitList(v) }},
	{"AMQP_URL", "broker.rabbitmq.url", func(c *Config, v string) { c.Broker.RabbitMQ.URL = v }},
	{"NATS_URL", "broker.nats.url", func(c *Config, v string) { c.Broker.NATS.URL = v }},
}

func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// LoadConfig reads the YAML file at path, expands ${VAR} and ${VAR:-default}
// in its values, applies the environment overrides (DATABASE_URL,
// MILLRACE_BROKER_KIND, KAFKA_BROKERS, AMQP_URL, NATS_URL), fills defaults and
// validates. Every problem is returned at once in a *ConfigError.
func LoadConfig(path string) (Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("read millrace config: %w", err)
	}
	cfg, err := parseConfig(data, os.LookupEnv)
	if ce, ok := err.(*ConfigError); ok {
		ce.Source = path
	}
	return cfg, err
}

// ParseConfig is LoadConfig for YAML already in memory.
func ParseConfig(data []byte) (Config, error) {
	return parseConfig(data, os.LookupEnv)
}

func parseConfig(data []byte, lookup confload.LookupEnv) (Config, error) {
	var cfg Config
	problems := confload.Decode(data, &cfg, lookup)
	for _, o := range envOverrides {
		if v, ok := lookup(o.env); ok && v != "" {
			o.apply(&cfg, v)
			if cfg.envSources == nil {
				cfg.envSources = map[string]string{}
			}
			cfg.envSources[o.path] = o.env
		}
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		problems = append(problems, err.(*ConfigError).Problems...)
	}
	if len(problems) > 0 {
		return cfg, &ConfigError{Problems: problems}
	}
	valid := cfg
	cfg.valid = &valid
	return cfg, nil
}
