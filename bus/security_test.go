package bus_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"net/url"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testcerts"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testlog"
	"github.com/millrace-io/millrace/ops"
)

// withQuery returns raw with the query parameters set.
func withQuery(t *testing.T, raw string, params map[string]string) string {
	t.Helper()
	u, err := url.Parse(raw)
	require.NoError(t, err)
	q := u.Query()
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// TestDatabaseTLS connects to a real PostgreSQL server over TLS through
// database.url's libpq parameters, which pgx implements: a private cluster
// of the test's own with ssl on and a certificate from a test CA.
func TestDatabaseTLS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	serverCA := testcerts.NewCA(t, "postgres")
	server := serverCA.Server("postgres")
	pg := servers.StartPostgreSQLWithTLS(t, server.CertFile, server.KeyFile)
	db, err := sql.Open("pgx", pg.URL)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, bus.KindNATS, &cfg)
	require.NoError(t, bus.Migrate(ctx, db, cfg))

	usesTLS := func(t *testing.T, dbURL string) bool {
		t.Helper()
		c := cfg
		c.Database.URL = dbURL
		b, err := bus.Open[*sql.DB](ctx, c, nil)
		require.NoError(t, err)
		defer b.Close()
		var on bool
		require.NoError(t, b.DB().QueryRow(`SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()`).Scan(&on))
		return on
	}
	require.True(t, usesTLS(t, withQuery(t, pg.URL, map[string]string{"sslmode": "require"})))
	require.False(t, usesTLS(t, withQuery(t, pg.URL, map[string]string{"sslmode": "disable"})))
	require.True(t, usesTLS(t, withQuery(t, pg.URL, map[string]string{"sslmode": "verify-ca", "sslrootcert": serverCA.CertFile})),
		"verify-ca with the CA that signed the server's certificate")

	wrong := testcerts.NewCA(t, "not-postgres")
	for _, mode := range []string{"verify-ca", "verify-full"} {
		c := cfg
		c.Database.URL = withQuery(t, pg.URL, map[string]string{"sslmode": mode, "sslrootcert": wrong.CertFile})
		_, err := bus.Open[*sql.DB](ctx, c, nil)
		require.Error(t, err, mode)
		// verify-ca fails on the unknown signer; verify-full may fail on the
		// name first (a server certificate made for another host).
		require.ErrorContains(t, err, "x509: ", mode)
		if mode == "verify-ca" {
			require.ErrorContains(t, err, "certificate signed by unknown authority")
		}
		require.ErrorContains(t, err, "database.connect_timeout", "the error says which setting it came from")
	}
}

func TestDatabaseURLTLSParametersAreChecked(t *testing.T) {
	t.Parallel()
	const secret = "db-S3cret-0a0a"
	missing := filepath.Join(t.TempDir(), "missing.pem")
	cases := map[string]string{
		"sslmode=verify-fulll":                       `database.url: sslmode must be one of disable, allow, prefer, require, verify-ca, verify-full; got "verify-fulll"`,
		"sslmode=verify-full&sslrootcert=" + missing: "database.url: sslrootcert " + missing + " cannot be read: no such file or directory",
		"sslcert=" + missing:                         "database.url: sslcert and sslkey go together",
		"sslmode=require&password=" + secret:         "",
		"sslmode=verify-full&sslrootcert=system":     "",
	}
	for query, want := range cases {
		_, err := bus.ParseConfig([]byte("database:\n  url: postgres://app:" + secret + "@db:5432/app?" + query + "\nbroker:\n  nats:\n    url: nats://127.0.0.1:4222\n"))
		if want == "" {
			require.NoError(t, err, query)
			continue
		}
		require.ErrorContains(t, err, want, query)
		require.NotContains(t, err.Error(), secret, query)
	}
}

func newSecret(t *testing.T, label string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return label + "-S3cret-" + hex.EncodeToString(b)
}

var errTestPoison = errors.New("refused on purpose")

// Secrets fed through config errors, failing connects and a running
// service never reach an error, a log line or the poison table.
func TestSecretsNeverPrinted(t *testing.T) {
	t.Parallel()

	t.Run("config errors", testSecretsInConfigErrors)

	t.Run("database connect", testSecretsInDatabaseConnect)

	t.Run("broker connect", testSecretsInBrokerConnect)

	// A running service (relay, handler, poison) with a NATS token in the URL
	// and a database password in the query: the token must stay out of the
	// logs of a whole round trip, and out of the poison table.
	t.Run("running service", testSecretsInRunningService)
}

func testSecretsInConfigErrors(t *testing.T) {
	t.Parallel()
	s := newSecret(t, "cfg")
	for _, yaml := range []string{
		"database:\n  url: postgres://app:" + s + "@db/app?sslmode=nope\n",
		"database:\n  url: postgres://db/app?password=" + s + "&sslmode=nope\n",
		"database:\n  url: mysql://app:" + s + "@db/app\n",
		"database:\n  url: \"postgres://app:" + s + "${@db/app\"\n",
		"broker:\n  kind: rabbitmq\n  rabbitmq:\n    url: http://guest:" + s + "@h/\n",
		"broker:\n  kind: rabbitmq\n  rabbitmq:\n    url: amqp://guest:" + s + "@h/\n    user: app\n    password: " + s + "\n",
		"broker:\n  kind: nats\n  nats:\n    url: http://" + s + "@h:4222\n",
		"broker:\n  kind: nats\n  nats:\n    url: nats://h:4222\n    token: " + s + "\n    password: " + s + "\n",
		"broker:\n  kind: kafka\n  kafka:\n    brokers: [k:9092]\n    sasl: {mechanism: GSSAPI, user: app, password: " + s + "}\n",
		"broker:\n  kind: kafka\n  kafka:\n    brokers: [k:9092]\n    sasl: {mechanism: PLAIN, password: \"" + s + "${x\"}\n",
		"broker:\n  kind: kafka\n  kafka:\n    brokers: [k:9092]\n    sasl: " + s + "\n",
	} {
		_, err := bus.ParseConfig([]byte(yaml))
		require.Error(t, err, yaml)
		require.NotContains(t, err.Error(), s, yaml)
	}
}

func testSecretsInDatabaseConnect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newSecret(t, "db")
	var logs testlog.Buffer
	for _, dbURL := range []string{
		"postgres://nobody_" + hex.EncodeToString([]byte(s[:4])) + ":" + s + "@127.0.0.1:5432/postgres?sslmode=disable&connect_timeout=5",
		"postgres://app:" + s + "@127.0.0.1:1/postgres?sslmode=disable",
		"postgres://127.0.0.1:1/postgres?user=app&password=" + s + "&sslmode=disable",
	} {
		var cfg bus.Config
		cfg.Database.URL = dbURL
		brokertest.Apply(t, bus.KindNATS, &cfg)
		_, err := bus.Open[*sql.DB](ctx, cfg, nil, bus.WithLogger(logs.Slog()))
		require.Error(t, err, dbURL)
		require.ErrorContains(t, err, "database")
		require.NotContains(t, err.Error(), s)
	}
	require.NotContains(t, logs.String(), s)

	// OpenDB parses the URL itself; a config built in code skips LoadConfig.
	for _, bad := range []string{"postgres://app:" + s + "@127.0.0.1:port/db", "postgres://app:" + s + "@127.0.0.1/db?sslmode=nope"} {
		db, err := bus.OpenDB(bus.DatabaseConfig{URL: bad})
		if err == nil { // the driver may parse on first use
			err = db.Ping()
			db.Close()
		}
		require.Error(t, err, bad)
		require.NotContains(t, err.Error(), s)
	}
}

func testSecretsInBrokerConnect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newSecret(t, "broker")
	sasl, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(0), kfake.EnableSASL(),
		kfake.Superuser("SCRAM-SHA-256", "app", "the-right-one"))
	require.NoError(t, err)
	t.Cleanup(sasl.Close)

	var rabbitCfg, rabbitFields, natsTokenCfg, natsPwCfg, kafkaCfg bus.Config
	brokertest.Apply(t, bus.KindRabbitMQ, &rabbitCfg)
	u, err := url.Parse(rabbitCfg.Broker.RabbitMQ.URL)
	require.NoError(t, err)
	user := "guest"
	if u.User != nil {
		user = u.User.Username()
	}
	u.User = url.UserPassword(user, s)
	rabbitCfg.Broker.RabbitMQ.URL = u.String()
	brokertest.Apply(t, bus.KindRabbitMQ, &rabbitFields)
	u.User = nil
	rabbitFields.Broker.RabbitMQ.URL = u.String()
	rabbitFields.Broker.RabbitMQ.User, rabbitFields.Broker.RabbitMQ.Password = user, s

	natsTokenCfg.Broker.Kind = bus.KindNATS
	natsTokenCfg.Broker.NATS.URL = "nats://" + s + "@127.0.0.1:1"
	natsPwCfg.Broker.Kind = bus.KindNATS
	natsPwCfg.Broker.NATS.URL = "nats://127.0.0.1:1"
	natsPwCfg.Broker.NATS.User, natsPwCfg.Broker.NATS.Password = "app", s

	kafkaCfg.Broker.Kind = bus.KindKafka
	kafkaCfg.Broker.Kafka = kafka.Config{Brokers: sasl.ListenAddrs(), ReplicationFactor: 1,
		SASL: kafka.SASLConfig{Mechanism: kafka.SASLScramSHA256, User: "app", Password: s}}

	for name, cfg := range map[string]bus.Config{
		"rabbitmq password in url": rabbitCfg, "rabbitmq password field": rabbitFields,
		"nats token in url": natsTokenCfg, "nats password field": natsPwCfg, "kafka sasl": kafkaCfg,
	} {
		var logs testlog.Buffer
		cfg.Broker.ConnectTimeout = 5 * time.Second
		_, err := bus.OpenBroker(ctx, cfg, watermill.NewSlogLogger(logs.Slog()))
		require.Error(t, err, name)
		require.NotContains(t, err.Error(), s, name)
		require.NotContains(t, logs.String(), s, name)
	}
}

func testSecretsInRunningService(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newSecret(t, "run")
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.Schema = testdb.Schema(t, db)
	brokertest.Apply(t, bus.KindNATS, &cfg)
	u, err := url.Parse(cfg.Broker.NATS.URL)
	require.NoError(t, err)
	if u.User == nil {
		// The shared server has no authentication and ignores the token;
		// the point is where millrace prints the URL.
		u.User = url.User(s)
	} else if pw, ok := u.User.Password(); ok {
		s = pw // a real server's own password is the secret to keep
	}
	cfg.Broker.NATS.URL = u.String()
	cfg.Consumer.Retry.MaxAttempts = 1
	topic := testdb.UniqueName("secret")[2:]
	brokertest.Cleanup(t, bus.KindNATS, topic, "h")
	require.NoError(t, bus.Migrate(ctx, db, cfg))

	var logs testlog.Buffer
	b, err := bus.Open(ctx, cfg, db, bus.WithLogger(logs.Slog()))
	require.NoError(t, err)
	defer b.Close()
	handled := make(chan struct{}, 1)
	require.NoError(t, b.Handle(topic, "h", func(context.Context, bus.Event) error {
		handled <- struct{}{}
		return bus.Permanent(errTestPoison)
	}))
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	require.NoError(t, b.PublishInOwnTx(ctx, topic, bus.Event{Type: "T", AggregateType: "a", AggregateID: "1", Payload: []byte(`{}`)}))
	select {
	case <-handled:
	case <-time.After(60 * time.Second):
		t.Fatal("the event never reached the handler")
	}
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".millrace_poison`).Scan(&n))
		return n == 1
	}, 60*time.Second, 20*time.Millisecond)
	oc, err := ops.New(ctx, db, b.Config())
	require.NoError(t, err)
	require.Eventually(t, func() bool { // the relay records its position at most every 100ms
		st, err := oc.OutboxStatus(ctx, "")
		require.NoError(t, err)
		return st.Pending == 0
	}, 60*time.Second, 20*time.Millisecond)
	stop()
	require.NoError(t, <-done)

	out := logs.String()
	require.Contains(t, out, "Connected to NATS JetStream", "the connect log line was written")
	require.Contains(t, out, "Message poisoned")
	require.NotContains(t, out, s)
	var poisoned string
	require.NoError(t, db.QueryRow(`SELECT metadata::text || reason FROM "`+cfg.Database.Schema+`".millrace_poison`).Scan(&poisoned))
	require.NotContains(t, poisoned, s)
	require.Contains(t, out, "xxxxx@", "the URL is logged, redacted")
}
