package adapters_test

import (
	"bytes"
	"crypto/tls"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/testing/testcerts"
)

func paths(errs []error) []string {
	var out []string
	for _, e := range errs {
		out = append(out, e.(*confload.FieldError).Path)
	}
	return out
}

func TestTLSConfigDefaultsAndOff(t *testing.T) {
	t.Parallel()
	c := adapters.TLSConfig{}.WithDefaults()
	require.Equal(t, adapters.TLS12, c.MinVersion)
	require.Empty(t, c.Validate("broker.kafka.tls", false))
	require.Empty(t, c.Validate("broker.kafka.tls", true), "TLS with the system roots needs no file")

	// Settings without TLS would silently talk plaintext: refused.
	c.CAFile = "/etc/ca.pem"
	errs := c.Validate("broker.kafka.tls", false)
	require.Equal(t, []string{"broker.kafka.tls.enabled"}, paths(errs))
	require.ErrorContains(t, errs[0], "TLS is off")
}

func TestTLSConfigBuildsClientConfig(t *testing.T) {
	t.Parallel()
	ca := testcerts.NewCA(t, "tlsconf")
	client := ca.Client("app")
	c := adapters.TLSConfig{Enabled: true, CAFile: ca.CertFile, CertFile: client.CertFile, KeyFile: client.KeyFile,
		ServerName: "broker.internal", MinVersion: adapters.TLS13}
	require.Empty(t, c.Validate("broker.nats.tls", true))
	conf, err := c.ClientConfig("broker.nats.tls")
	require.NoError(t, err)
	require.Equal(t, uint16(tls.VersionTLS13), conf.MinVersion)
	require.Equal(t, "broker.internal", conf.ServerName)
	require.False(t, conf.InsecureSkipVerify)
	require.Len(t, conf.Certificates, 1)
	require.True(t, conf.RootCAs.Equal(ca.Pool()), "the pool is exactly ca_file's certificates")
}

func TestTLSConfigFileErrorsNameTheKey(t *testing.T) {
	t.Parallel()
	ca := testcerts.NewCA(t, "files")
	pair := ca.Client("app")
	other := ca.Client("other")
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	require.NoError(t, os.WriteFile(notPEM, []byte("hello"), 0o600))
	missing := filepath.Join(dir, "missing.pem")

	cases := []struct {
		name string
		c    adapters.TLSConfig
		path string
		want string
	}{
		{"missing CA", adapters.TLSConfig{CAFile: missing}, "x.tls.ca_file", "cannot read " + missing},
		{"CA without PEM", adapters.TLSConfig{CAFile: notPEM}, "x.tls.ca_file", "no PEM certificate found in " + notPEM},
		{"cert without key", adapters.TLSConfig{CertFile: pair.CertFile}, "x.tls.key_file", "required with cert_file"},
		{"key without cert", adapters.TLSConfig{KeyFile: pair.KeyFile}, "x.tls.cert_file", "required with key_file"},
		{"missing key file", adapters.TLSConfig{CertFile: pair.CertFile, KeyFile: missing}, "x.tls.key_file", "cannot read " + missing},
		{"key of another cert", adapters.TLSConfig{CertFile: pair.CertFile, KeyFile: other.KeyFile}, "x.tls.cert_file", "does not match"},
		{"bad version", adapters.TLSConfig{MinVersion: "1.0"}, "x.tls.min_version", `must be "1.2" or "1.3"; got "1.0"`},
	}
	for _, tc := range cases {
		tc.c.Enabled = true
		errs := tc.c.WithDefaults().Validate("x.tls", true)
		require.Len(t, errs, 1, tc.name)
		require.Equal(t, tc.path, paths(errs)[0], tc.name)
		require.ErrorContains(t, errs[0], tc.want, tc.name)
	}

	// A key file's contents never reach the error.
	key, err := os.ReadFile(other.KeyFile)
	require.NoError(t, err)
	_, err = adapters.TLSConfig{CertFile: pair.CertFile, KeyFile: other.KeyFile}.ClientConfig("x.tls")
	require.Error(t, err)
	body := strings.Split(string(key), "\n")[1]
	require.NotContains(t, err.Error(), body[:20])
}

func TestWarnInsecureIsLoud(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(&buf, nil)))
	adapters.TLSConfig{}.WarnInsecure(logger, "broker.rabbitmq.tls")
	require.Empty(t, buf.String(), "no warning when certificates are verified")
	adapters.TLSConfig{InsecureSkipVerify: true}.WarnInsecure(logger, "broker.rabbitmq.tls")
	require.Contains(t, buf.String(), "level=ERROR")
	require.Contains(t, buf.String(), "broker.rabbitmq.tls.insecure_skip_verify is true")
	require.Contains(t, buf.String(), "never use this in production")
}
