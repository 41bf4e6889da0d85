package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/internal/testing/testcerts"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testlog"
)

// These tests need a cluster with known users and certificates, so they run
// against a private kfake cluster with SASL and TLS on (kfake implements
// PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512 and TLS listeners), even when
// KAFKA_BROKERS names a real cluster.

// Secrets are distinctive so that a leak is found by a plain substring search.
const (
	plainSecret  = "plain-S3cret-7f1c"
	scram256Pass = "scram256-S3cret-a4b2"
	scram512Pass = "scram512-S3cret-99de"
)

type secureCluster struct {
	addrs []string
	ca    *testcerts.CA
}

func startSecureCluster(t *testing.T) secureCluster {
	t.Helper()
	ca := testcerts.NewCA(t, "kafka")
	c, err := kfake.NewCluster(
		kfake.NumBrokers(1),
		kfake.Ports(0),
		kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "plain-user", plainSecret),
		kfake.Superuser("SCRAM-SHA-256", "scram256-user", scram256Pass),
		kfake.Superuser("SCRAM-SHA-512", "scram512-user", scram512Pass),
		kfake.TLS(testcerts.ServerTLS(ca.Server("kafka"), nil)),
	)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return secureCluster{addrs: c.ListenAddrs(), ca: ca}
}

func (s secureCluster) config(mechanism, user, password string) kafka.Config {
	return kafka.Config{
		Brokers:           s.addrs,
		ReplicationFactor: 1,
		HeartbeatInterval: 500 * time.Millisecond,
		TLS:               adapters.TLSConfig{Enabled: true, CAFile: s.ca.CertFile},
		SASL:              kafka.SASLConfig{Mechanism: mechanism, User: user, Password: password},
	}
}

func TestSASLOverTLSEveryMechanism(t *testing.T) {
	t.Parallel()
	cluster := startSecureCluster(t)
	for _, tc := range []struct{ mechanism, user, password string }{
		{kafka.SASLPlain, "plain-user", plainSecret},
		{kafka.SASLScramSHA256, "scram256-user", scram256Pass},
		{kafka.SASLScramSHA512, "scram512-user", scram512Pass},
	} {
		t.Run(tc.mechanism, func(t *testing.T) {
			t.Parallel()
			var logs testlog.Buffer
			ctx := context.Background()
			b, err := kafka.Open(ctx, cluster.config(tc.mechanism, tc.user, tc.password),
				adapters.Options{Logger: logs.Watermill(), ConnectTimeout: 30 * time.Second})
			require.NoError(t, err)
			defer b.Close()

			topic := testdb.UniqueName(t.Name())
			require.NoError(t, b.Provision(ctx, topic, "g"))
			sub, err := b.Subscriber(adapters.SubscriberSpec{Group: "g"})
			require.NoError(t, err)
			sctx, cancel := context.WithCancel(ctx)
			defer cancel()
			msgs, err := sub.Subscribe(sctx, topic)
			require.NoError(t, err)
			sent := message.NewMessage(watermill.NewUUID(), []byte(`{"over":"tls"}`))
			require.NoError(t, b.PublishBatch(ctx, []adapters.Outgoing{{Topic: topic, Msg: sent}}))
			select {
			case got := <-msgs:
				require.Equal(t, sent.UUID, got.UUID)
				got.Ack()
			case <-time.After(30 * time.Second):
				t.Fatal("the message published over TLS and SASL never arrived")
			}
			require.NoError(t, sub.Close())
			require.NoError(t, b.Close())
			require.NotContains(t, logs.String(), tc.password)
		})
	}
}

func TestSASLFailuresAreClearAndKeepTheSecret(t *testing.T) {
	t.Parallel()
	cluster := startSecureCluster(t)
	wrongCA := testcerts.NewCA(t, "not-kafkas")
	const wrongPassword = "wrong-S3cret-0b5e"

	cases := []struct {
		name   string
		cfg    kafka.Config
		want   string
		secret string
	}{
		{"wrong SCRAM password", cluster.config(kafka.SASLScramSHA512, "scram512-user", wrongPassword),
			`over TLS with SASL SCRAM-SHA-512 as user "scram512-user"`, wrongPassword},
		{"wrong PLAIN password", cluster.config(kafka.SASLPlain, "plain-user", wrongPassword),
			"refused the SASL credentials", wrongPassword},
		{"unknown CA", func() kafka.Config {
			c := cluster.config(kafka.SASLScramSHA256, "scram256-user", scram256Pass)
			c.TLS.CAFile = wrongCA.CertFile
			return c
		}(), "certificate signed by unknown authority", scram256Pass},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var logs testlog.Buffer
			_, err := kafka.Open(context.Background(), tc.cfg, adapters.Options{Logger: logs.Watermill(), ConnectTimeout: 10 * time.Second})
			require.Error(t, err)
			require.ErrorContains(t, err, tc.want)
			require.ErrorContains(t, err, cluster.addrs[0], "the error names the broker")
			require.NotContains(t, err.Error(), tc.secret)
			require.NotContains(t, logs.String(), tc.secret)
		})
	}
}

func TestSecurityConfigValidate(t *testing.T) {
	t.Parallel()
	base := kafka.Config{Brokers: []string{"k:9093"}}
	cases := []struct {
		name string
		edit func(c *kafka.Config)
		path string
		want string
	}{
		{"unknown mechanism", func(c *kafka.Config) { c.SASL = kafka.SASLConfig{Mechanism: "GSSAPI", User: "u", Password: "p"} },
			"broker.kafka.sasl.mechanism", "must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"},
		{"no user", func(c *kafka.Config) { c.SASL = kafka.SASLConfig{Mechanism: "PLAIN", Password: "p"} },
			"broker.kafka.sasl.user", "required with mechanism PLAIN"},
		{"no password", func(c *kafka.Config) { c.SASL = kafka.SASLConfig{Mechanism: "SCRAM-SHA-256", User: "u"} },
			"broker.kafka.sasl.password", "required with mechanism SCRAM-SHA-256"},
		{"credentials without mechanism", func(c *kafka.Config) { c.SASL = kafka.SASLConfig{User: "u", Password: "p"} },
			"broker.kafka.sasl.mechanism", "required when user or password is set"},
		{"TLS settings with TLS off", func(c *kafka.Config) { c.TLS.CAFile = "/ca.pem" },
			"broker.kafka.tls.enabled", "TLS settings are given but TLS is off"},
		{"dev cluster with SASL", func(c *kafka.Config) {
			c.Brokers = []string{"127.0.0.1:0"}
			c.DevCluster = true
			c.SASL = kafka.SASLConfig{Mechanism: "PLAIN", User: "u", Password: "p"}
		}, "broker.kafka.dev_cluster", "the in-process dev cluster speaks neither TLS nor SASL"},
	}
	for _, tc := range cases {
		c := base
		tc.edit(&c)
		errs := c.WithDefaults().Validate("broker.kafka")
		require.Len(t, errs, 1, "%s: %v", tc.name, errs)
		require.Contains(t, errs[0].Error(), tc.path+": "+tc.want, tc.name)
	}
}

// SASL PLAIN over plaintext works but is logged at error level: it sends
// the password itself.
func TestPlainWithoutTLSIsWarnedAbout(t *testing.T) {
	t.Parallel()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(0), kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "plain-user", plainSecret))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	var logs testlog.Buffer
	b, err := kafka.Open(context.Background(), kafka.Config{Brokers: c.ListenAddrs(), ReplicationFactor: 1,
		SASL: kafka.SASLConfig{Mechanism: kafka.SASLPlain, User: "plain-user", Password: plainSecret}},
		adapters.Options{Logger: logs.Watermill(), ConnectTimeout: 10 * time.Second})
	require.NoError(t, err)
	require.NoError(t, b.Provision(context.Background(), testdb.UniqueName(t.Name()), "g"))
	require.NoError(t, b.Close())
	require.Contains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), "PLAIN without tls.enabled sends the password in clear text")
	require.NotContains(t, logs.String(), plainSecret)
}
