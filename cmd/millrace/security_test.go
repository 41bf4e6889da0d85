package main

import (
	"bytes"
	"context"
	"net/url"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// No command prints a secret: not --help, not a config error, not a failed
// connection to the database or the broker.
func TestCommandsNeverPrintSecrets(t *testing.T) {
	const secret = "cli-S3cret-4d4d"
	orig := map[string]string{}
	for _, k := range []string{"DATABASE_URL", "AMQP_URL", "NATS_URL"} {
		orig[k] = os.Getenv(k)
	}
	t.Setenv("DATABASE_URL", "postgres://app:"+secret+"@127.0.0.1:1/app?sslmode=disable")
	t.Setenv("AMQP_URL", "amqp://guest:"+secret+"@127.0.0.1:1/")
	t.Setenv("NATS_URL", "nats://"+secret+"@127.0.0.1:1")

	var out, errOut bytes.Buffer
	for _, args := range [][]string{{"--help"}, {"migrate", "--help"}, {"relay", "--help"}, {"outbox", "status", "--help"}} {
		require.Equal(t, exitOK, run(context.Background(), args, &out, &errOut), args)
	}
	require.Contains(t, out.String(), "usage: millrace")
	require.NotContains(t, out.String()+errOut.String(), secret)
	for k, v := range orig {
		t.Setenv(k, v) // the real services again, for what follows
	}

	db := testdb.Open(t)
	schema := testdb.SchemaName(t, db, t.Name())
	var rabbit bus.Config
	brokertest.Apply(t, bus.KindRabbitMQ, &rabbit)
	u, err := url.Parse(rabbit.Broker.RabbitMQ.URL)
	require.NoError(t, err)
	u.User = url.UserPassword("guest", secret)
	wrongRabbit := u.String()
	t.Setenv("DATABASE_URL", "") // the configs below name their database
	t.Setenv("AMQP_URL", "")

	cases := []struct {
		name   string
		config string
		args   []string
		code   int
	}{
		{"unreachable database", "database:\n  url: postgres://app:" + secret + "@127.0.0.1:1/app?sslmode=disable\nbroker:\n  nats: {url: nats://127.0.0.1:4222}\n",
			[]string{"migrate"}, exitFailed},
		{"password in the query", "database:\n  url: postgres://127.0.0.1:1/app?user=app&password=" + secret + "\nbroker:\n  nats: {url: nats://127.0.0.1:4222}\n",
			[]string{"outbox", "status"}, exitFailed},
		{"config error", "database:\n  url: postgres://app:" + secret + "@db/app?sslmode=on\nbroker:\n  nats: {url: \"nats://" + secret + "@h:4222\", token: x}\n",
			[]string{"migrate"}, exitUsage},
		{"refused broker credentials", "database:\n  url: " + testdb.URL() + "\n  schema: " + schema + "\nbroker:\n  kind: rabbitmq\n  connect_timeout: 5s\n  rabbitmq: {url: \"" + wrongRabbit + "\"}\n",
			[]string{"relay"}, exitFailed},
	}
	path := writeConfig(t, cases[3].config)
	require.Equal(t, exitOK, run(context.Background(), []string{"--config", path, "migrate"}, &out, &errOut), errOut.String())
	for _, tc := range cases {
		out.Reset()
		errOut.Reset()
		code := run(context.Background(), append([]string{"--config", writeConfig(t, tc.config)}, tc.args...), &out, &errOut)
		require.Equal(t, tc.code, code, "%s: %s", tc.name, errOut.String())
		require.NotEmpty(t, errOut.String(), tc.name)
		require.NotContains(t, out.String()+errOut.String(), secret, tc.name)
	}
}

// A hostile --metrics address is refused before anything starts.
func TestRelayRefusesHostileMetricsAddress(t *testing.T) {
	t.Parallel()
	path := writeConfig(t, "broker:\n  nats: {url: nats://127.0.0.1:4222}\n")
	for _, addr := range []string{"127.0.0.1:9464\nX", "evil host:9464", "127.0.0.1:http", "127.0.0.1", "[::1]:99999"} {
		var out, errOut bytes.Buffer
		code := run(context.Background(), []string{"--config", path, "relay", "--metrics", addr}, &out, &errOut)
		require.Equal(t, exitUsage, code, "%q: %s", addr, errOut.String())
		require.Contains(t, errOut.String(), "metrics.listen: must be host:port", addr)
		require.NotContains(t, out.String(), "relay: outbox", "%q: the relay did not start", addr)
	}
}

func TestGrantsCommand(t *testing.T) {
	t.Parallel()
	path := writeConfig(t, "database:\n  schema: billing\nbroker:\n  nats: {url: nats://127.0.0.1:4222}\n")
	var out, errOut bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"--config", path, "grants", "--role", "billing_app"}, &out, &errOut), errOut.String())
	cfg, err := bus.LoadConfig(path)
	require.NoError(t, err)
	want, err := bus.GrantSQL(cfg, "billing_app")
	require.NoError(t, err)
	require.Equal(t, want, out.String())
	require.Contains(t, out.String(), `GRANT INSERT ON TABLE "billing"."watermill_millrace_outbox" TO "billing_app";`)

	out.Reset()
	require.Equal(t, exitOK, run(context.Background(), []string{"--config", path, "grants", "--role", "billing_app", "--json"}, &out, &errOut))
	require.Contains(t, out.String(), `"privilege": "USAGE"`)

	for _, args := range [][]string{{"grants"}, {"grants", "--role", `x"; DROP TABLE y; --`}} {
		errOut.Reset()
		require.Equal(t, exitUsage, run(context.Background(), append([]string{"--config", path}, args...), &out, &errOut), args)
		require.Contains(t, errOut.String(), "role", args)
	}
}
