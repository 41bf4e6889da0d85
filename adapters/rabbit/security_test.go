package rabbit

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testcerts"
	"github.com/millrace-io/millrace/internal/testing/testlog"
)

// TestTLSOnPrivateNode runs a private RabbitMQ node with a TLS listener that
// requires client certificates (the shared server has none, and its
// configuration is not ours to change) and connects to it over amqps://.
func TestTLSOnPrivateNode(t *testing.T) {
	t.Parallel()
	n := startTLSNode(t)

	t.Run("round trip over mutual TLS", func(t *testing.T) { testTLSRoundTrip(t, n) })
	t.Run("TLS in the URL", func(t *testing.T) {
		var logs testlog.Buffer
		q := url.Values{"cacertfile": {n.ca.CertFile}, "certfile": {n.client.CertFile}, "keyfile": {n.client.KeyFile}}
		b, err := n.open(t, testConfig(fmt.Sprintf("amqps://guest:guest@127.0.0.1:%d/?%s", n.tlsPort, q.Encode())), &logs)
		require.NoError(t, err, "amqp091's URL parameters still work when the tls block is empty")
		conn, err := b.connection(context.Background())
		require.NoError(t, err)
		require.True(t, conn.ConnectionState().HandshakeComplete)
	})
	t.Run("unknown CA", func(t *testing.T) {
		var logs testlog.Buffer
		c := n.secureCfg()
		c.TLS.CAFile = testcerts.NewCA(t, "stranger").CertFile
		_, err := n.open(t, c, &logs)
		require.ErrorContains(t, err, "certificate signed by unknown authority")
		require.ErrorContains(t, err, "connect to "+n.amqps)
	})
	t.Run("no client certificate", func(t *testing.T) {
		var logs testlog.Buffer
		c := n.secureCfg()
		c.TLS.CertFile, c.TLS.KeyFile = "", ""
		_, err := n.open(t, c, &logs)
		// Under TLS 1.3 the node rejects the missing certificate after the
		// client's side of the handshake has finished, so what the client
		// reads first varies: the "certificate required" alert, a reset, or
		// the closed connection under the AMQP handshake. The same settings
		// with the certificate connect (the subtests above).
		require.Error(t, err, "the node requires a client certificate")
		require.ErrorContains(t, err, "connect to "+n.amqps)
	})
	t.Run("wrong password", func(t *testing.T) {
		var logs testlog.Buffer
		const wrong = "wrong-S3cret-rabbit"
		c := n.secureCfg()
		c.Password = wrong
		_, err := n.open(t, c, &logs)
		require.ErrorContains(t, err, "username or password not allowed")
		require.NotContains(t, err.Error(), wrong)
		require.NotContains(t, logs.String(), wrong)
	})
	t.Run("insecure skip verify warns", func(t *testing.T) {
		var logs testlog.Buffer
		c := n.secureCfg()
		c.TLS.CAFile, c.TLS.InsecureSkipVerify = "", true
		b, err := n.open(t, c, &logs)
		require.NoError(t, err)
		require.NoError(t, b.Close())
		require.Contains(t, logs.String(), "level=ERROR")
		require.Contains(t, logs.String(), "broker.rabbitmq.tls.insecure_skip_verify is true")
	})
	t.Run("plain listener still plain", func(t *testing.T) {
		var logs testlog.Buffer
		b, err := n.open(t, testConfig(n.plainURL), &logs)
		require.NoError(t, err)
		conn, err := b.connection(context.Background())
		require.NoError(t, err)
		require.False(t, conn.ConnectionState().HandshakeComplete, "amqp:// is not TLS")
	})
}

// tlsNode is a private RabbitMQ node with a plain listener and a TLS one
// that requires client certificates of ca.
type tlsNode struct {
	ca       *testcerts.CA
	client   testcerts.Pair
	tlsPort  int
	amqps    string // the TLS listener's URL, without credentials
	plainURL string
}

func startTLSNode(t *testing.T) *tlsNode {
	ca := testcerts.NewCA(t, "rabbit")
	server := ca.Server("rabbit")
	tlsPort := servers.FreePort(t)
	node := servers.StartRabbitMQ(t, fmt.Sprintf(`listeners.ssl.1 = 127.0.0.1:%d
ssl_options.cacertfile = %s
ssl_options.certfile = %s
ssl_options.keyfile = %s
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
`, tlsPort, ca.CertFile, server.CertFile, server.KeyFile), "")
	return &tlsNode{ca: ca, client: ca.Client("millrace"), tlsPort: tlsPort,
		amqps: fmt.Sprintf("amqps://127.0.0.1:%d/", tlsPort), plainURL: node.URL}
}

// secureCfg is a Config for the TLS listener with the client certificate.
func (n *tlsNode) secureCfg() Config {
	c := testConfig(n.amqps)
	c.User, c.Password = "guest", "guest"
	c.TLS = adapters.TLSConfig{CAFile: n.ca.CertFile, CertFile: n.client.CertFile, KeyFile: n.client.KeyFile}
	return c
}

// open opens c, logging to logs, and closes the Broker when t ends.
func (n *tlsNode) open(t *testing.T, c Config, logs *testlog.Buffer) (*Broker, error) {
	b, err := Open(context.Background(), c, adapters.Options{Logger: logs.Watermill(), ConnectTimeout: 10 * time.Second})
	if err == nil {
		t.Cleanup(func() { _ = b.Close() })
	}
	return b, err
}

// testTLSRoundTrip publishes and receives a message over mutual TLS.
func testTLSRoundTrip(t *testing.T, n *tlsNode) {
	var logs testlog.Buffer
	b, err := n.open(t, n.secureCfg(), &logs)
	require.NoError(t, err)
	conn, err := b.connection(context.Background())
	require.NoError(t, err)
	state := conn.ConnectionState()
	require.True(t, state.HandshakeComplete, "the connection is TLS")
	require.NotEmpty(t, state.PeerCertificates)
	require.Equal(t, "rabbit", state.PeerCertificates[0].Subject.CommonName)

	topic, group := provisioned(t, b, "tls")
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: group})
	require.NoError(t, err)
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := newMsg(`{"over":"amqps"}`)
	require.NoError(t, b.PublishBatch(context.Background(), adaptertest.Outgoing(topic, m)))
	got := adaptertest.Receive(t, msgs, 1, time.Minute)
	require.Equal(t, m.UUID, got[0].UUID)
}

// Credentials in user/password instead of the URL, against the shared server.
func TestCredentialsOutsideTheURL(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(serverURL())
	require.NoError(t, err)
	if u.User == nil {
		u.User = url.UserPassword("guest", "guest")
	}
	user := u.User.Username()
	password, _ := u.User.Password()
	u.User = nil

	c := testConfig(u.String())
	c.User, c.Password = user, password
	b, err := Open(context.Background(), c, adapters.Options{ConnectTimeout: 10 * time.Second})
	require.NoError(t, err)
	require.NoError(t, b.Close())

	const wrong = "wrong-S3cret-9f9f"
	var logs testlog.Buffer
	c.Password = wrong
	_, err = Open(context.Background(), c, adapters.Options{Logger: logs.Watermill(), ConnectTimeout: 10 * time.Second})
	require.ErrorContains(t, err, "username or password not allowed")
	require.NotContains(t, err.Error(), wrong)
	require.NotContains(t, logs.String(), wrong)

	// A password in the URL is redacted in the same error.
	u.User = url.UserPassword(user, wrong)
	_, err = Open(context.Background(), testConfig(u.String()), adapters.Options{Logger: logs.Watermill(), ConnectTimeout: 10 * time.Second})
	require.ErrorContains(t, err, "username or password not allowed")
	require.ErrorContains(t, err, user+":xxxxx@")
	require.NotContains(t, err.Error(), wrong)
	require.NotContains(t, logs.String(), wrong)
}

func TestSecurityConfigValidate(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		cfg  Config
		path string
		want string
	}{
		{"TLS on with amqp://", Config{URL: "amqp://h/", TLS: adapters.TLSConfig{Enabled: true}}, "broker.rabbitmq.url",
			"tls.enabled is true but the URL is not amqps://"},
		{"TLS settings with amqp://", Config{URL: "amqp://h/", TLS: adapters.TLSConfig{CAFile: "/ca.pem"}}, "broker.rabbitmq.tls.enabled",
			"TLS settings are given but TLS is off"},
		{"TLS in two places", Config{URL: "amqps://h/?cacertfile=/a.pem", TLS: adapters.TLSConfig{ServerName: "h"}}, "broker.rabbitmq.tls",
			"TLS is set both here and in the URL (cacertfile)"},
		{"credentials in two places", Config{URL: "amqp://a:b@h/", User: "u", Password: "p"}, "broker.rabbitmq.user",
			"the URL has credentials too"},
		{"password without user", Config{URL: "amqp://h/", Password: "p"}, "broker.rabbitmq.user", "required with password"},
		{"user without password", Config{URL: "amqp://h/", User: "u"}, "broker.rabbitmq.password", "required with user"},
	}
	for _, tc := range cases {
		errs := tc.cfg.WithDefaults().Validate("broker.rabbitmq")
		require.Len(t, errs, 1, "%s: %v", tc.name, errs)
		require.Equal(t, tc.path, errs[0].(*confload.FieldError).Path, tc.name)
		require.ErrorContains(t, errs[0], tc.want, tc.name)
		require.False(t, strings.Contains(errs[0].Error(), ":b@"), "no password in %s", tc.name)
	}
	require.Empty(t, Config{URL: "amqps://h/", TLS: adapters.TLSConfig{ServerName: "h"}}.WithDefaults().Validate("broker.rabbitmq"))
}

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c := Config{URL: defaultURL}.WithDefaults()
	require.Equal(t, Config{
		URL:                  defaultURL,
		Prefetch:             1,
		DeliveryLimit:        20,
		MaxMessageBytes:      128 << 20,
		Heartbeat:            10 * time.Second,
		ReconnectMaxInterval: 5 * time.Second,
		TLS:                  adapters.TLSConfig{MinVersion: adapters.TLS12},
	}, c)
	require.Empty(t, c.Validate("broker.rabbitmq"))
	set := Config{URL: defaultURL, Prefetch: 50, DeliveryLimit: 3, MaxMessageBytes: 1 << 20, Heartbeat: time.Minute, ReconnectMaxInterval: time.Second,
		TLS: adapters.TLSConfig{MinVersion: adapters.TLS13}}
	require.Equal(t, set, set.WithDefaults(), "set values are kept")
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	c := Config{
		URL:                  "http://user:hunter2@host/",
		Prefetch:             70000,
		DeliveryLimit:        -1,
		MaxMessageBytes:      1 << 30,
		Heartbeat:            500 * time.Millisecond,
		ReconnectMaxInterval: -time.Second,
	}
	errs := c.Validate("broker.rabbitmq")
	paths := map[string]string{}
	for _, err := range errs {
		var fe *confload.FieldError
		require.True(t, errors.As(err, &fe), "%T", err)
		paths[fe.Path] = fe.Problem
		require.NotContains(t, fe.Problem, "hunter2")
	}
	require.Len(t, errs, 6, "%v", errs)
	require.Contains(t, paths["broker.rabbitmq.url"], "scheme")
	require.Contains(t, paths["broker.rabbitmq.prefetch"], "65535")
	require.Contains(t, paths["broker.rabbitmq.delivery_limit"], "greater than 0")
	require.Contains(t, paths["broker.rabbitmq.max_message_bytes"], "536870912")
	require.Contains(t, paths["broker.rabbitmq.heartbeat"], "at least 1s")
	require.Contains(t, paths["broker.rabbitmq.reconnect_max_interval"], "positive")

	require.Empty(t, Config{}.WithDefaults().Validate("broker.rabbitmq"), "the defaults are valid: a local server")
	require.Equal(t, DefaultURL, Config{}.WithDefaults().URL)
}

// broker.rabbitmq.url takes a cluster's nodes as a list; each is checked,
// one scheme for all, and the broker's errors name them without passwords.
func TestConfigClusterList(t *testing.T) {
	t.Parallel()
	c := Config{URL: "amqp://u:hunter2@a:5672/, amqp://u:hunter2@b:5672/"}.WithDefaults()
	require.Empty(t, c.Validate("broker.rabbitmq"))
	require.Equal(t, []string{"amqp://u:hunter2@a:5672/", "amqp://u:hunter2@b:5672/"}, c.urls())
	require.True(t, c.urlCredentials())
	require.NotContains(t, redactList(c.urls()), "hunter2")

	for _, tc := range []struct{ url, want string }{
		{"amqp://a/,http://b/", "scheme"},
		{"amqp://a/,amqps://b/", "every node of the list uses one scheme; got amqp:// and amqps://"},
	} {
		errs := Config{URL: tc.url}.WithDefaults().Validate("broker.rabbitmq")
		require.Len(t, errs, 1, "%s: %v", tc.url, errs)
		var fe *confload.FieldError
		require.ErrorAs(t, errs[0], &fe)
		require.Equal(t, "broker.rabbitmq.url", fe.Path)
		require.Contains(t, fe.Problem, tc.want)
	}
}

// The shipped config.yaml states this section's defaults.
func TestShippedConfigStatesDefaults(t *testing.T) {
	t.Parallel()
	var shipped Config
	noEnv := func(string) (string, bool) { return "", false }
	require.Empty(t, confload.Decode(adaptertest.ShippedSection(t, "rabbitmq"), &shipped, noEnv))
	require.Equal(t, Config{URL: shipped.URL}.WithDefaults(), shipped)
}
