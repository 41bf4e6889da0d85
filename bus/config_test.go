package bus

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func noEnv(string) (string, bool) { return "", false }

func envOf(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestShippedConfigLoadsAndValidates(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile("../config.yaml")
	require.NoError(t, err)
	cfg, err := parseConfig(data, noEnv)
	require.NoError(t, err)
	require.Equal(t, KindNATS, cfg.Broker.Kind)
	require.Equal(t, DefaultDatabaseURL, cfg.Database.URL)
	require.Equal(t, "millrace_outbox", cfg.Outbox.Topic)
	require.Equal(t, 10*time.Second, cfg.Broker.ConnectTimeout)
	// The shipped file states the defaults: loading it equals defaulting nothing.
	defaults := Config{}.WithDefaults()
	require.Equal(t, defaults.Database, cfg.Database)
	require.Equal(t, defaults.Outbox, cfg.Outbox)
	require.Equal(t, defaults.Consumer, cfg.Consumer)
	require.Equal(t, defaults.Broker, cfg.Broker)
	require.Equal(t, defaults.Metrics, cfg.Metrics)
	require.Equal(t, defaults.Health, cfg.Health)
}

// A stall timeout shorter than a loop's longest quiet spell would fail
// liveness on a healthy process: it is refused, naming what it must exceed.
func TestStallTimeoutMustExceedTheQuietSpells(t *testing.T) {
	t.Parallel()
	_, err := parseConfig([]byte(`health: {stall_timeout: 20s}
consumer:
  handlers:
    slow: {handler_timeout: 30s}
`), noEnv)
	require.Error(t, err)
	require.Contains(t, err.Error(), "health.stall_timeout: must exceed consumer.handler_timeout plus the longer of retry.max_interval and breaker.open_timeout (40s); got 20s")
	require.Contains(t, err.Error(), "consumer.handlers.slow.handler_timeout")
	_, err = parseConfig([]byte("health: {stall_timeout: 5s}\nrelay: {retry_max: 10s}\n"), noEnv)
	require.ErrorContains(t, err, "health.stall_timeout: must exceed relay.retry_max (10s); got 5s")
	_, err = parseConfig([]byte("health: {check_timeout: -1s}\nmetrics: {inbox_rows_interval: 0s}\n"), noEnv)
	require.ErrorContains(t, err, "health.check_timeout")
}

func TestMinimalConfigIsAllDefaults(t *testing.T) {
	t.Parallel()
	cfg, err := parseConfig([]byte("broker:\n  nats:\n    url: nats://127.0.0.1:4222\n"), noEnv)
	require.NoError(t, err)
	want := Config{}.WithDefaults()
	want.Broker.NATS.URL = "nats://127.0.0.1:4222"
	cfg.valid = nil
	require.Equal(t, want, cfg)

	// The broker addresses config.yaml documents are the defaults: a file
	// without a broker section reaches the local servers.
	cfg, err = parseConfig(nil, noEnv)
	require.NoError(t, err)
	require.Equal(t, "nats://127.0.0.1:4222", cfg.Broker.NATS.URL)
	require.Equal(t, "amqp://127.0.0.1:5672/", cfg.Broker.RabbitMQ.URL)
	cfg.valid = nil
	require.Equal(t, want, cfg)
}

func TestConfigEnvironment(t *testing.T) {
	t.Parallel()
	env := envOf(map[string]string{
		"DATABASE_URL":         "postgres://app:secret@db:5432/app",
		"MILLRACE_BROKER_KIND": "kafka",
		"KAFKA_BROKERS":        "k1:9092, k2:9092",
		"SCHEMA_NAME":          "billing",
	})
	cfg, err := parseConfig([]byte(`
database:
  schema: ${SCHEMA_NAME}
  connect_timeout: ${CONNECT_TIMEOUT:-3s}
outbox:
  max_payload_bytes: ${MAX_PAYLOAD:-2048}
broker:
  kind: nats
`), env)
	require.NoError(t, err)
	require.Equal(t, "billing", cfg.Database.Schema)
	require.Equal(t, 3*time.Second, cfg.Database.ConnectTimeout)
	require.Equal(t, 2048, cfg.Outbox.MaxPayloadBytes)
	require.Equal(t, "postgres://app:secret@db:5432/app", cfg.Database.URL)
	require.Equal(t, KindKafka, cfg.Broker.Kind, "MILLRACE_BROKER_KIND overrides the YAML")
	require.Equal(t, []string{"k1:9092", "k2:9092"}, cfg.Broker.Kafka.Brokers)
}

func TestBadConfigsNameTheirField(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		yaml  string
		env   map[string]string
		paths []string // every path that must be reported
		text  string   // a fragment the message must contain
	}{
		{name: "wrong kind", yaml: "broker:\n  kind: kafak\n",
			paths: []string{"broker.kind"}, text: `must be one of kafka, rabbitmq, nats; got "kafak"`},
		{name: "empty rabbitmq url", yaml: "broker:\n  kind: rabbitmq\n  rabbitmq:\n    url: \"amqp://\"\n",
			paths: []string{"broker.rabbitmq.url"}, text: "no host"},
		{name: "empty kafka broker", yaml: "broker:\n  kind: kafka\n  kafka:\n    brokers: [\"\"]\n",
			paths: []string{"broker.kafka.brokers[0]"}, text: ""},
		{name: "wrong url scheme", yaml: "broker:\n  nats:\n    url: http://x:4222\n",
			paths: []string{"broker.nats.url"}, text: `"http"`},
		{name: "negative duration", yaml: "database:\n  connect_timeout: -5s\nbroker:\n  connect_timeout: -1s\n",
			paths: []string{"database.connect_timeout", "broker.connect_timeout"}, text: "must be a positive duration"},
		{name: "not a duration", yaml: "database:\n  connect_timeout: 5\n",
			paths: []string{"database.connect_timeout"}, text: "a duration"},
		{name: "unknown key", yaml: "broker:\n  kind: nats\n  kafak:\n    brokers: [x]\n",
			paths: []string{"broker.kafak"}, text: "unknown key"},
		{name: "unknown top-level key", yaml: "databse:\n  url: x\n",
			paths: []string{"databse"}, text: "unknown key"},
		{name: "duplicate key", yaml: "outbox:\n  codec: json\n  codec: bytes\n",
			paths: []string{"outbox.codec"}, text: "duplicate"},
		{name: "bad yaml", yaml: "broker: [kind: nats\n", text: "invalid YAML"},
		{name: "wrong shape", yaml: "broker: nats\n", paths: []string{"broker"}, text: "expected a mapping"},
		{name: "bad codec and sizes", yaml: "outbox:\n  codec: xml\n  max_payload_bytes: -1\n  max_metadata_bytes: lots\n",
			paths: []string{"outbox.codec", "outbox.max_payload_bytes", "outbox.max_metadata_bytes"}},
		{name: "hostile schema", yaml: "database:\n  schema: 'x\"; DROP TABLE users; --'\n",
			paths: []string{"database.schema"}, text: "must match"},
		{name: "unset variable", yaml: "database:\n  url: ${NO_SUCH_VARIABLE}\n",
			paths: []string{"database.url"}, text: "NO_SUCH_VARIABLE is not set"},
		{name: "consumer section", yaml: "consumer:\n  workers: -2\n  retry:\n    max_attempts: -1\n  handlers:\n    billing:\n      prefetch: 1\n      poison: {destination: topic}\n",
			paths: []string{"consumer.workers", "consumer.retry.max_attempts"}, text: "must be greater than 0"},
		{name: "consumer handler override", yaml: "consumer:\n  handlers:\n    billing:\n      prefetch: 1\n      poison: {destination: topic}\n      inbox: {retention: 1h}\n",
			paths: []string{"consumer.handlers.billing.prefetch", "consumer.handlers.billing.poison.topic", "consumer.handlers.billing.inbox.retention"}, text: "must be at least workers"},
		{name: "max_deliver below max_attempts", yaml: "broker:\n  kind: nats\n  nats:\n    consumer: {max_deliver: 3}\nconsumer:\n  retry: {max_attempts: 4}\n  handlers:\n    audit: {ordered: true, retry: {max_attempts: 9}}\n",
			paths: []string{"broker.nats.consumer.max_deliver"}, text: "at least consumer.retry.max_attempts (4)"},
		{name: "bad url from environment", env: map[string]string{"AMQP_URL": "localhost"}, yaml: "broker:\n  kind: rabbitmq\n",
			paths: []string{"broker.rabbitmq.url"}, text: "$AMQP_URL"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := parseConfig([]byte(tc.yaml), envOf(tc.env))
			require.Error(t, err)
			var ce *ConfigError
			require.ErrorAs(t, err, &ce)
			for _, p := range tc.paths {
				found := false
				for _, prob := range ce.Problems {
					var fe *FieldError
					if errors.As(prob, &fe) && fe.Path == p {
						found = true
					}
				}
				require.True(t, found, "no problem reported at %s in:\n%v", p, err)
			}
			require.Contains(t, err.Error(), tc.text)
		})
	}
}

// JetStream's max_deliver only has to leave room for the attempts of
// unordered handlers (an ordered handler retries within one delivery).
func TestConfigMaxDeliverCoversUnorderedAttempts(t *testing.T) {
	t.Parallel()
	ok := "broker:\n  kind: nats\n  nats:\n    consumer: {max_deliver: 5}\nconsumer:\n  retry: {max_attempts: 5}\n  handlers:\n    audit: {ordered: true, retry: {max_attempts: 9}}\n"
	_, err := parseConfig([]byte(ok), noEnv)
	require.NoError(t, err)
	_, err = parseConfig([]byte(ok+"    billing: {retry: {max_attempts: 6}}\n"), noEnv)
	require.ErrorContains(t, err, "broker.nats.consumer.max_deliver: must be -1 (no limit) or at least consumer.handlers.billing.retry.max_attempts (6)")
	require.NotContains(t, err.Error(), "audit")
	_, err = parseConfig([]byte(ok+"    billing: {retry: {max_attempts: 6, mode: process}}\n"), noEnv)
	require.NoError(t, err, "retry.mode process retries within one delivery")
}

func TestConfigReportsEveryProblemAtOnce(t *testing.T) {
	t.Parallel()
	_, err := parseConfig([]byte("broker:\n  kind: kafak\n  connect_timeout: -1s\noutbox:\n  codec: xml\n  nope: 1\n"), noEnv)
	var ce *ConfigError
	require.ErrorAs(t, err, &ce)
	require.Len(t, ce.Problems, 4, err.Error())
}

func TestConfigErrorsDoNotPrintPasswords(t *testing.T) {
	t.Parallel()
	_, err := parseConfig([]byte("broker:\n  kind: rabbitmq\n  rabbitmq:\n    url: http://user:hunter2@host/\n"), noEnv)
	require.Error(t, err)
	require.NotContains(t, err.Error(), "hunter2")
	require.True(t, strings.Contains(err.Error(), "broker.rabbitmq.url"))
}

func FuzzParseConfig(f *testing.F) {
	shipped, err := os.ReadFile("../config.yaml")
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range []string{string(shipped), "", "broker: {kind: kafka, kafka: {brokers: [a]}}", "a: [1, {b: *x}]",
		"database:\n  url: ${X:-${Y}}\n", "outbox: !!binary aGk=", "- 1\n- 2", "{{{", "broker:\n  kind: &k nats\n  nats: {url: *k}"} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		_, err := parseConfig(data, noEnv)
		if err == nil {
			return
		}
		var ce *ConfigError
		if !errors.As(err, &ce) || len(ce.Problems) == 0 {
			t.Fatalf("not a *ConfigError with problems: %T %v", err, err)
		}
	})
}

// A start checks its config once: Open, Migrate and ops.New do not validate
// (and read the files of) a config LoadConfig validated, unless it changed.
func TestConfigIsCheckedOncePerStart(t *testing.T) {
	t.Parallel()
	root := filepath.Join(t.TempDir(), "ca.pem")
	require.NoError(t, os.WriteFile(root, []byte("not read until checked"), 0o600))
	yaml := "database:\n  url: postgres://u@127.0.0.1:5432/db?sslmode=verify-full&sslrootcert=" + root + "\n"
	cfg, err := parseConfig([]byte(yaml), noEnv)
	require.NoError(t, err)
	require.NoError(t, os.Remove(root))

	_, err = cfg.check()
	require.NoError(t, err, "unchanged since it was validated: not checked again")
	changed := cfg
	changed.Outbox.MaxPayloadBytes = 10
	_, err = changed.check()
	require.ErrorContains(t, err, "sslrootcert", "changed: checked again, and the removed file is found missing")
	_, err = Config{Database: cfg.Database}.check()
	require.ErrorContains(t, err, "sslrootcert", "built in code: checked")
}

// relay.shards from the YAML is checked with its path: 0 is refused, not
// taken as unset.
func TestRelayShardsFromYAMLAreChecked(t *testing.T) {
	t.Parallel()
	_, err := parseConfig([]byte("relay: {shards: 0}\n"), noEnv)
	require.ErrorContains(t, err, "relay.shards: must be at least 1")
	cfg, err := parseConfig([]byte("relay: {shards: 1}\n"), noEnv)
	require.NoError(t, err)
	require.Equal(t, 1, *cfg.Relay.Shards)
	cfg, err = parseConfig([]byte("relay: {shards: 8}\n"), noEnv)
	require.NoError(t, err)
	require.Equal(t, 8, *cfg.Relay.Shards)
	_, err = parseConfig([]byte("relay: {shards: 1000}\n"), noEnv)
	require.ErrorContains(t, err, "relay.shards: must be at most 256")
}
