package nats

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
	"github.com/millrace-io/millrace/internal/testing/testcerts"
	"github.com/millrace-io/millrace/internal/testing/testlog"
)

// These tests need servers with known certificates and credentials, so
// each starts a private nats-server (in process, JetStream on) configured
// for it, whatever NATS_URL says.

// startSecureServer starts a private JetStream server configured by tweak
// and returns its nats:// URL.
func startSecureServer(t *testing.T, tweak func(o *server.Options)) string {
	t.Helper()
	o := &server.Options{
		Host: "127.0.0.1", Port: server.RANDOM_PORT,
		JetStream: true, StoreDir: t.TempDir(), NoSigs: true, NoLog: true,
	}
	tweak(o)
	srv, err := server.NewServer(o)
	require.NoError(t, err)
	srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	require.True(t, srv.ReadyForConnections(30*time.Second), "private nats-server did not start")
	return "nats://" + srv.Addr().String()
}

// roundTrip publishes one message through b and receives it in a group,
// proving the connection works end to end (publish, stream and consumer
// management, push subscription).
func roundTrip(t *testing.T, b *Broker) {
	t.Helper()
	ctx := context.Background()
	topic := adaptertest.Name("secure")
	sub, err := b.Subscriber(adapters.SubscriberSpec{Group: "g"})
	require.NoError(t, err)
	defer sub.Close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msgs, err := sub.Subscribe(sctx, topic)
	require.NoError(t, err)
	require.NoError(t, b.PublishBatch(ctx, adaptertest.Outgoing(topic, newMsg("over-tls"))))
	select {
	case m := <-msgs:
		require.Equal(t, "over-tls", m.UUID)
		m.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("the message never arrived")
	}
}

func openSecure(t *testing.T, cfg Config, logs *testlog.Buffer) (*Broker, error) {
	t.Helper()
	b, err := Open(context.Background(), cfg, adapters.Options{Logger: logs.Watermill(), ConnectTimeout: 10 * time.Second})
	if err == nil {
		t.Cleanup(func() { _ = b.Close() })
	}
	return b, err
}

func TestTLSAgainstPrivateServer(t *testing.T) {
	t.Parallel()
	ca := testcerts.NewCA(t, "nats")
	url := startSecureServer(t, func(o *server.Options) {
		o.TLSConfig = testcerts.ServerTLS(ca.Server("nats"), nil)
		o.TLS = true
	})

	t.Run("trusted CA", func(t *testing.T) {
		var logs testlog.Buffer
		b, err := openSecure(t, Config{URL: url, TLS: adapters.TLSConfig{Enabled: true, CAFile: ca.CertFile}}, &logs)
		require.NoError(t, err)
		roundTrip(t, b)
		require.True(t, b.nc.TLSRequired(), "the server asked for TLS")
		state, err := b.nc.TLSConnectionState()
		require.NoError(t, err)
		require.True(t, state.HandshakeComplete)
	})
	t.Run("tls scheme", func(t *testing.T) {
		var logs testlog.Buffer
		tlsURL := strings.Replace(url, "nats://", "tls://", 1)
		b, err := openSecure(t, Config{URL: tlsURL, TLS: adapters.TLSConfig{CAFile: ca.CertFile}}, &logs)
		require.NoError(t, err, "a tls:// URL turns TLS on and takes the tls block")
		roundTrip(t, b)
	})
	t.Run("wrong CA", func(t *testing.T) {
		var logs testlog.Buffer
		other := testcerts.NewCA(t, "other")
		_, err := openSecure(t, Config{URL: url, TLS: adapters.TLSConfig{Enabled: true, CAFile: other.CertFile}}, &logs)
		require.Error(t, err)
		require.ErrorContains(t, err, "certificate signed by unknown authority")
		require.ErrorContains(t, err, url, "the error names the server")
	})
	t.Run("system roots only", func(t *testing.T) {
		var logs testlog.Buffer
		_, err := openSecure(t, Config{URL: url, TLS: adapters.TLSConfig{Enabled: true}}, &logs)
		require.ErrorContains(t, err, "certificate signed by unknown authority")
	})
	t.Run("wrong server name", func(t *testing.T) {
		var logs testlog.Buffer
		_, err := openSecure(t, Config{URL: url, TLS: adapters.TLSConfig{Enabled: true, CAFile: ca.CertFile, ServerName: "nats.example.com"}}, &logs)
		require.ErrorContains(t, err, "nats.example.com")
	})
	t.Run("insecure skip verify warns", func(t *testing.T) {
		var logs testlog.Buffer
		b, err := openSecure(t, Config{URL: url, TLS: adapters.TLSConfig{Enabled: true, InsecureSkipVerify: true}}, &logs)
		require.NoError(t, err)
		require.NoError(t, b.Close())
		require.Contains(t, logs.String(), "level=ERROR")
		require.Contains(t, logs.String(), "broker.nats.tls.insecure_skip_verify is true")
	})
	t.Run("plaintext client", func(t *testing.T) {
		var logs testlog.Buffer
		// nats.go upgrades to TLS when the server requires it, and then
		// cannot verify a certificate of a private CA.
		_, err := openSecure(t, Config{URL: url}, &logs)
		require.ErrorContains(t, err, "tls error")
	})
}

func TestMutualTLSAgainstPrivateServer(t *testing.T) {
	t.Parallel()
	ca := testcerts.NewCA(t, "nats-mtls")
	url := startSecureServer(t, func(o *server.Options) {
		o.TLSConfig = testcerts.ServerTLS(ca.Server("nats"), ca)
		o.TLS, o.TLSVerify = true, true
	})
	client := ca.Client("millrace")
	var logs testlog.Buffer
	b, err := openSecure(t, Config{URL: url, TLS: adapters.TLSConfig{
		Enabled: true, CAFile: ca.CertFile, CertFile: client.CertFile, KeyFile: client.KeyFile}}, &logs)
	require.NoError(t, err)
	roundTrip(t, b)

	_, err = openSecure(t, Config{URL: url, TLS: adapters.TLSConfig{Enabled: true, CAFile: ca.CertFile}}, &logs)
	require.Error(t, err, "without a client certificate the server refuses the connection")
	require.ErrorContains(t, err, "cannot connect to "+url)
}

// Each way to authenticate, against a server that requires it; the wrong
// secret fails with a clear error, and no secret reaches an error or a log.
func TestCredentialsAgainstPrivateServers(t *testing.T) {
	t.Parallel()
	const (
		password = "pw-S3cret-51a7"
		token    = "tok-S3cret-c0de"
		wrong    = "wrong-S3cret-e9e9"
	)
	userURL := startSecureServer(t, func(o *server.Options) {
		o.Users = []*server.User{{Username: "app", Password: password}}
	})
	tokenURL := startSecureServer(t, func(o *server.Options) { o.Authorization = token })

	userKP, err := nkeys.CreateUser()
	require.NoError(t, err)
	userPub, err := userKP.PublicKey()
	require.NoError(t, err)
	userSeed, err := userKP.Seed()
	require.NoError(t, err)
	nkeyURL := startSecureServer(t, func(o *server.Options) { o.Nkeys = []*server.NkeyUser{{Nkey: userPub}} })
	seedFile := filepath.Join(t.TempDir(), "user.nk")
	require.NoError(t, os.WriteFile(seedFile, userSeed, 0o600))
	otherKP, err := nkeys.CreateUser()
	require.NoError(t, err)
	otherSeed, err := otherKP.Seed()
	require.NoError(t, err)
	otherSeedFile := filepath.Join(t.TempDir(), "other.nk")
	require.NoError(t, os.WriteFile(otherSeedFile, otherSeed, 0o600))

	credsURL, credsFile, foreignCreds := operatorModeServer(t)

	cases := []struct {
		name    string
		cfg     Config
		ok      bool
		secrets []string
	}{
		{"user and password", Config{URL: userURL, User: "app", Password: password}, true, []string{password}},
		{"wrong password", Config{URL: userURL, User: "app", Password: wrong}, false, []string{wrong}},
		{"password in the URL", Config{URL: strings.Replace(userURL, "nats://", "nats://app:"+wrong+"@", 1)}, false, []string{wrong}},
		{"token", Config{URL: tokenURL, Token: token}, true, []string{token}},
		{"wrong token", Config{URL: tokenURL, Token: wrong}, false, []string{wrong}},
		{"token in the URL", Config{URL: strings.Replace(tokenURL, "nats://", "nats://"+wrong+"@", 1)}, false, []string{wrong}},
		{"nkey seed file", Config{URL: nkeyURL, NKeySeedFile: seedFile}, true, []string{string(userSeed)}},
		{"unknown nkey", Config{URL: nkeyURL, NKeySeedFile: otherSeedFile}, false, []string{string(otherSeed)}},
		{"creds file", Config{URL: credsURL, CredsFile: credsFile}, true, nil},
		{"creds of another operator", Config{URL: credsURL, CredsFile: foreignCreds}, false, nil},
		{"no credentials", Config{URL: tokenURL}, false, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var logs testlog.Buffer
			b, err := openSecure(t, tc.cfg, &logs)
			if tc.ok {
				require.NoError(t, err)
				roundTrip(t, b)
				require.NoError(t, b.Close())
			} else {
				require.Error(t, err)
				require.ErrorContains(t, err, "cannot connect to")
				require.ErrorContains(t, err, "Authorization Violation")
			}
			for _, s := range tc.secrets {
				if err != nil {
					require.NotContains(t, err.Error(), s)
				}
				require.NotContains(t, logs.String(), s)
			}
		})
	}
}

// operatorModeServer starts a server in operator (JWT) mode with one
// JetStream-enabled account, and returns its URL, a .creds file of a user
// of that account, and a .creds file of a user of an unknown operator.
func operatorModeServer(t *testing.T) (url, creds, foreign string) {
	t.Helper()
	operator, err := nkeys.CreateOperator()
	require.NoError(t, err)
	opPub, _ := operator.PublicKey()
	// JetStream in operator mode needs a system account.
	system, sysJWT := newAccount(t, operator, false)
	sysPub, _ := system.PublicKey()
	opClaims := jwt.NewOperatorClaims(opPub)
	opClaims.SystemAccount = sysPub
	opJWT, err := opClaims.Encode(operator)
	require.NoError(t, err)
	opClaims, err = jwt.DecodeOperatorClaims(opJWT)
	require.NoError(t, err)

	account, accJWT := newAccount(t, operator, true)
	accPub, _ := account.PublicKey()
	resolver := &server.MemAccResolver{}
	require.NoError(t, resolver.Store(accPub, accJWT))
	require.NoError(t, resolver.Store(sysPub, sysJWT))
	url = startSecureServer(t, func(o *server.Options) {
		o.TrustedOperators = []*jwt.OperatorClaims{opClaims}
		o.AccountResolver = resolver
		o.SystemAccount = sysPub
	})
	creds = writeCreds(t, account)

	stranger, err := nkeys.CreateOperator()
	require.NoError(t, err)
	strangerAccount, _ := newAccount(t, stranger, true)
	return url, creds, writeCreds(t, strangerAccount)
}

func newAccount(t *testing.T, operator nkeys.KeyPair, jetStream bool) (nkeys.KeyPair, string) {
	t.Helper()
	account, err := nkeys.CreateAccount()
	require.NoError(t, err)
	pub, _ := account.PublicKey()
	claims := jwt.NewAccountClaims(pub)
	if jetStream {
		claims.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	}
	encoded, err := claims.Encode(operator)
	require.NoError(t, err)
	return account, encoded
}

func writeCreds(t *testing.T, account nkeys.KeyPair) string {
	t.Helper()
	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	pub, _ := user.PublicKey()
	claims := jwt.NewUserClaims(pub)
	userJWT, err := claims.Encode(account)
	require.NoError(t, err)
	seed, _ := user.Seed()
	body, err := jwt.FormatUserConfig(userJWT, seed)
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "user.creds")
	require.NoError(t, os.WriteFile(path, body, 0o600))
	return path
}

func TestSecurityConfigValidate(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	notASeed := filepath.Join(dir, "seed.nk")
	require.NoError(t, os.WriteFile(notASeed, []byte("hello"), 0o600))
	cases := []struct {
		name string
		cfg  Config
		path string
		want string
	}{
		{"two methods", Config{URL: "nats://h:4222", Token: "t", User: "u", Password: "p"}, "broker.nats.token",
			"only one way to authenticate may be set; got user and token"},
		{"URL and user", Config{URL: "nats://a:b@h:4222", User: "u", Password: "p"}, "broker.nats.user",
			"only one way to authenticate may be set; got url and user"},
		{"password without user", Config{URL: "nats://h:4222", Password: "p"}, "broker.nats.user", "required with password"},
		{"user without password", Config{URL: "nats://h:4222", User: "u"}, "broker.nats.password", "required with user"},
		{"missing seed file", Config{URL: "nats://h:4222", NKeySeedFile: filepath.Join(dir, "nope.nk")}, "broker.nats.nkey_seed_file",
			"no such file or directory"},
		{"not a seed", Config{URL: "nats://h:4222", NKeySeedFile: notASeed}, "broker.nats.nkey_seed_file", "cannot use " + notASeed},
		{"not a creds file", Config{URL: "nats://h:4222", CredsFile: notASeed}, "broker.nats.creds_file", "no user JWT in it"},
		{"TLS settings without TLS", Config{URL: "nats://h:4222", TLS: adapters.TLSConfig{ServerName: "n"}}, "broker.nats.tls.enabled",
			"TLS settings are given but TLS is off"},
		{"embedded with a token", Config{URL: "nats://127.0.0.1:0", Token: "t", Embedded: EmbeddedConfig{Enabled: true}}, "broker.nats.token",
			"the embedded server takes credentials from url"},
	}
	for _, tc := range cases {
		errs := tc.cfg.WithDefaults().Validate("broker.nats")
		require.Len(t, errs, 1, "%s: %v", tc.name, errs)
		require.Equal(t, tc.path, errs[0].(*confload.FieldError).Path, tc.name)
		require.ErrorContains(t, errs[0], tc.want, tc.name)
	}
	require.Empty(t, Config{URL: "tls://h:4222", TLS: adapters.TLSConfig{ServerName: "n"}}.WithDefaults().Validate("broker.nats"),
		"a tls:// URL turns TLS on, so its settings are in use")
}

func TestRedactHidesPasswordsAndTokens(t *testing.T) {
	t.Parallel()
	require.Equal(t, "nats://app:xxxxx@h:4222", redact("nats://app:s3cret@h:4222"))
	require.Equal(t, "nats://xxxxx@h:4222", redact("nats://t0ken@h:4222"))
	require.Equal(t, "nats://h:4222", redact("nats://h:4222"))
}

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c := Config{URL: "nats://127.0.0.1:4222"}.WithDefaults()
	require.Equal(t, Config{
		URL: "nats://127.0.0.1:4222", PingInterval: 5 * time.Second,
		Stream: StreamConfig{
			Replicas: 1, MaxAge: 168 * time.Hour, DuplicateWindow: 2 * time.Minute,
		},
		Consumer: ConsumerConfig{
			AckWait: 60 * time.Second, MaxDeliver: -1, MaxAckPending: 32, NakDelay: 5 * time.Second, Subscribers: 1,
			LeaseTTL: 5 * time.Second,
		},
		Publish:  PublishConfig{Timeout: 30 * time.Second, MaxPending: 1024},
		Embedded: EmbeddedConfig{StoreDir: DefaultStoreDir(), Sync: SyncAlways},
		TLS:      adapters.TLSConfig{MinVersion: adapters.TLS12},
	}, c)
	require.Equal(t, c, c.WithDefaults(), "idempotent")
	require.Empty(t, c.Validate("broker.nats"))
}

// The shipped config.yaml states the defaults of broker.nats.
func TestConfigYAMLStatesDefaults(t *testing.T) {
	t.Parallel()
	section := adaptertest.ShippedSection(t, "nats")
	var c Config
	noEnv := func(string) (string, bool) { return "", false }
	require.Empty(t, confload.Decode(section, &c, noEnv))
	require.Equal(t, "", c.Embedded.StoreDir, "the file leaves store_dir to its default")
	require.Equal(t, Config{URL: "nats://127.0.0.1:4222"}.WithDefaults(), c.WithDefaults())

	// NATS_EMBEDDED=true turns the embedded server on.
	var on Config
	require.Empty(t, confload.Decode(section, &on, func(k string) (string, bool) {
		if k == "NATS_EMBEDDED" {
			return "true", true
		}
		return "", false
	}))
	require.True(t, on.Embedded.Enabled)
}

func TestConfigTakesAClusterSeedList(t *testing.T) {
	t.Parallel()
	c := Config{URL: "nats://a.example:4222, tls://user:secret@b.example:4222"}.WithDefaults()
	require.Empty(t, c.Validate("broker.nats"))
	require.True(t, c.tlsOn(), "a tls:// server in the list turns TLS on")
	require.Equal(t, []string{"url"}, c.authMethods())
	require.Equal(t, "nats://a.example:4222,tls://user:xxxxx@b.example:4222", redact(c.URL))
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{"no url", func(c *Config) { c.URL = "" }, "broker.nats.url: required"},
		{"ping_interval", func(c *Config) { c.PingInterval = -time.Second }, "broker.nats.ping_interval: must be a positive duration"},
		{"replicas", func(c *Config) { c.Stream.Replicas = 7 }, "broker.nats.stream.replicas: must be between 1 and 5; got 7"},
		{"max_age", func(c *Config) { c.Stream.MaxAge = -time.Second }, "broker.nats.stream.max_age: must be a positive duration"},
		{"max_bytes", func(c *Config) { c.Stream.MaxBytes = -2 }, "broker.nats.stream.max_bytes: must not be negative"},
		{"window over age", func(c *Config) { c.Stream.MaxAge = time.Minute; c.Stream.DuplicateWindow = time.Hour },
			"broker.nats.stream.duplicate_window: must not exceed stream.max_age (1m0s); got 1h0m0s"},
		{"max_msg_size", func(c *Config) { c.Stream.MaxMsgSize = -1 }, "broker.nats.stream.max_msg_size: must not be negative"},
		{"ack_wait", func(c *Config) { c.Consumer.AckWait = -1 }, "broker.nats.consumer.ack_wait: must be a positive duration"},
		{"max_deliver", func(c *Config) { c.Consumer.MaxDeliver = -5 }, "broker.nats.consumer.max_deliver: must be -1 (no limit) or at least 1; got -5"},
		{"max_ack_pending", func(c *Config) { c.Consumer.MaxAckPending = -1 }, "broker.nats.consumer.max_ack_pending: must be greater than 0"},
		{"nak_delay", func(c *Config) { c.Consumer.NakDelay = -time.Second }, "broker.nats.consumer.nak_delay: must be a positive duration"},
		{"subscribers", func(c *Config) { c.Consumer.Subscribers = -1 }, "broker.nats.consumer.subscribers: must be greater than 0"},
		{"lease_ttl", func(c *Config) { c.Consumer.LeaseTTL = -time.Second }, "broker.nats.consumer.lease_ttl: must be a positive duration"},
		{"publish timeout", func(c *Config) { c.Publish.Timeout = -1 }, "broker.nats.publish.timeout: must be a positive duration"},
		{"max_pending", func(c *Config) { c.Publish.MaxPending = -1 }, "broker.nats.publish.max_pending: must be greater than 0"},
		{"sync", func(c *Config) { c.Embedded.Sync = "never" }, `broker.nats.embedded.sync: must be "always" or a positive duration such as "2m"; got "never"`},
		{"cluster list with a bad server", func(c *Config) { c.URL = "nats://127.0.0.1:4222, http://127.0.0.1:4223" },
			`broker.nats.url: `},
		{"embedded on a list", func(c *Config) { c.Embedded.Enabled = true; c.URL = "nats://127.0.0.1:4222,nats://127.0.0.1:4223" },
			`broker.nats.url: the embedded server listens on one URL, not a list`},
		{"embedded port", func(c *Config) { c.Embedded.Enabled = true; c.URL = "nats://127.0.0.1:99999" },
			`broker.nats.url: the embedded server listens on this URL: invalid port "99999"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Config{URL: "nats://127.0.0.1:4222"}.WithDefaults()
			tc.mutate(&c)
			problems := c.Validate("broker.nats")
			require.Len(t, problems, 1, "%v", problems)
			var fe *confload.FieldError
			require.ErrorAs(t, problems[0], &fe)
			require.Contains(t, problems[0].Error(), tc.want)
		})
	}
}
