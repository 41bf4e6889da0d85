package adapters

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/internal/confload"
)

// TLS versions accepted by TLSConfig.MinVersion.
const (
	TLS12 = "1.2"
	TLS13 = "1.3"
)

// TLSConfig is the tls block every broker's section has (broker.kafka.tls,
// broker.rabbitmq.tls, broker.nats.tls): how the client verifies the broker
// and, for mutual TLS, which certificate it presents. It lives here, in the
// package every adapter imports, so that the three blocks are one type with
// one set of rules, and code that builds a Config can name it.
type TLSConfig struct {
	// Enabled turns TLS on. An amqps:// RabbitMQ URL or a tls:// NATS URL
	// turns it on as well. Setting any other key of the block while TLS is
	// off is an error, so a configuration never silently talks plaintext.
	// Defaults to false.
	Enabled bool `yaml:"enabled"`
	// CAFile is a PEM file of the certificate authorities trusted to sign
	// the broker's certificate. Defaults to "": the system's roots.
	CAFile string `yaml:"ca_file"`
	// CertFile is the PEM client certificate presented for mutual TLS,
	// with KeyFile. Defaults to "": no client certificate.
	CertFile string `yaml:"cert_file"`
	// KeyFile is the PEM private key of CertFile. Defaults to "".
	KeyFile string `yaml:"key_file"`
	// ServerName is the name the broker's certificate must carry (and the
	// SNI sent). Defaults to "": the host of the address dialled.
	ServerName string `yaml:"server_name"`
	// InsecureSkipVerify accepts any certificate the broker presents, so
	// anyone on the path can read and change the traffic. For a test setup
	// only; Open logs an error-level warning when it is on. Defaults to false.
	InsecureSkipVerify bool `yaml:"insecure_skip_verify"`
	// MinVersion is the oldest TLS version accepted: "1.2" or "1.3".
	// Defaults to "1.2".
	MinVersion string `yaml:"min_version"`
}

// WithDefaults returns c with every unset field at its default.
func (c TLSConfig) WithDefaults() TLSConfig {
	if c.MinVersion == "" {
		c.MinVersion = TLS12
	}
	return c
}

// Customized reports whether any key other than enabled and min_version is set.
func (c TLSConfig) Customized() bool {
	return c.CAFile != "" || c.CertFile != "" || c.KeyFile != "" || c.ServerName != "" || c.InsecureSkipVerify
}

// Validate returns every problem of the block at path (e.g.
// "broker.kafka.tls"), each a *confload.FieldError naming its key. on says
// whether TLS is on for the connection (Enabled, or a URL scheme that asks
// for it). When it is, the files are read and parsed, so a missing or
// malformed file is reported at load time with its key. Call it on a
// TLSConfig that has had WithDefaults applied.
func (c TLSConfig) Validate(path string, on bool) []error {
	var chk confload.Checker
	at := func(key string) string { return confload.Join(path, key) }
	if _, err := tlsVersion(c.MinVersion); err != nil {
		chk.Add(at("min_version"), "%v", err)
	}
	switch {
	case c.CertFile != "" && c.KeyFile == "":
		chk.Add(at("key_file"), "required with cert_file (mutual TLS needs the certificate and its key)")
	case c.CertFile == "" && c.KeyFile != "":
		chk.Add(at("cert_file"), "required with key_file (mutual TLS needs the certificate and its key)")
	}
	if !on {
		if c.Customized() {
			chk.Add(at("enabled"), "TLS settings are given but TLS is off: set enabled: true")
		}
		return chk.Problems
	}
	if len(chk.Problems) == 0 {
		if _, err := c.ClientConfig(path); err != nil {
			chk.Merge([]error{err})
		}
	}
	return chk.Problems
}

// ClientConfig builds the *tls.Config of the block at path, reading its
// files. An error is a *confload.FieldError naming the key whose file could
// not be used; it never quotes a file's contents.
func (c TLSConfig) ClientConfig(path string) (*tls.Config, error) {
	c = c.WithDefaults()
	at := func(key string) string { return confload.Join(path, key) }
	version, err := tlsVersion(c.MinVersion)
	if err != nil {
		return nil, confload.Errorf(at("min_version"), "%v", err)
	}
	conf := &tls.Config{
		MinVersion:         version,
		ServerName:         c.ServerName,
		InsecureSkipVerify: c.InsecureSkipVerify, //nolint:gosec // opt-in, warned about by WarnInsecure
	}
	if c.CAFile != "" {
		pem, err := os.ReadFile(c.CAFile)
		if err != nil {
			return nil, confload.Errorf(at("ca_file"), "cannot read %s: %v", c.CAFile, errors.Unwrap(err))
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, confload.Errorf(at("ca_file"), "no PEM certificate found in %s", c.CAFile)
		}
		conf.RootCAs = pool
	}
	if c.CertFile != "" || c.KeyFile != "" {
		if c.CertFile == "" || c.KeyFile == "" {
			return nil, confload.Errorf(at("cert_file"), "cert_file and key_file go together (mutual TLS needs both)")
		}
		for _, f := range []struct{ key, file string }{{"cert_file", c.CertFile}, {"key_file", c.KeyFile}} {
			if _, err := os.Stat(f.file); err != nil {
				return nil, confload.Errorf(at(f.key), "cannot read %s: %v", f.file, errors.Unwrap(err))
			}
		}
		pair, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
		if err != nil {
			// crypto/tls's messages name what is wrong (no PEM data, key
			// does not match the certificate), never the key material.
			return nil, confload.Errorf(at("cert_file"), "cannot use %s with key_file %s: %v", c.CertFile, c.KeyFile, err)
		}
		conf.Certificates = []tls.Certificate{pair}
	}
	return conf, nil
}

func tlsVersion(v string) (uint16, error) {
	switch v {
	case TLS12, "": // "" before WithDefaults
		return tls.VersionTLS12, nil
	case TLS13:
		return tls.VersionTLS13, nil
	}
	return 0, fmt.Errorf("must be %q or %q; got %q", TLS12, TLS13, v)
}

// ErrInsecureTLS is the error WarnInsecure logs: certificate verification is off.
var ErrInsecureTLS = errors.New("TLS certificate verification is disabled: anyone on the network path can impersonate the broker, read and change messages; never use this in production")

// WarnInsecure logs, at error level so it stands out, that the block at path
// skips certificate verification. It does nothing when c verifies.
func (c TLSConfig) WarnInsecure(logger watermill.LoggerAdapter, path string) {
	if c.InsecureSkipVerify && logger != nil {
		logger.Error("INSECURE: "+confload.Join(path, "insecure_skip_verify")+" is true", ErrInsecureTLS, nil)
	}
}
