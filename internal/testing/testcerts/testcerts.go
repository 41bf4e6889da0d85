// Package testcerts generates throwaway certificate authorities and
// certificates for tests, so that TLS is exercised against real servers
// without any key ever being committed.
package testcerts

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a certificate authority that signs server and client certificates.
type CA struct {
	Cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// CertFile is the CA certificate as a PEM file.
	CertFile string
	dir      string
	t        testing.TB
}

// Pair is a certificate and its key, in memory and as PEM files.
type Pair struct {
	// CertFile and KeyFile are PEM files in the test's temporary directory.
	CertFile, KeyFile string
	// TLS is the pair ready for a tls.Config.
	TLS tls.Certificate
}

// NewCA returns a fresh self-signed CA named name; its files live in a
// temporary directory removed when t ends.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{CommonName: name, Organization: []string{"millrace tests"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatalf("create CA certificate: %v", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatalf("parse CA certificate: %v", err)
	}
	dir := t.TempDir()
	ca := &CA{Cert: cert, key: key, dir: dir, t: t}
	ca.CertFile = writePEM(t, filepath.Join(dir, name+"-ca.pem"), "CERTIFICATE", der)
	return ca
}

// Pool is a cert pool holding only this CA.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Server issues a server certificate for 127.0.0.1, ::1 and localhost plus
// any extra DNS names.
func (ca *CA) Server(name string, dnsNames ...string) Pair {
	return ca.issue(name, x509.ExtKeyUsageServerAuth, append([]string{"localhost"}, dnsNames...))
}

// Client issues a client certificate whose common name is name.
func (ca *CA) Client(name string) Pair {
	return ca.issue(name, x509.ExtKeyUsageClientAuth, nil)
}

func (ca *CA) issue(name string, usage x509.ExtKeyUsage, dnsNames []string) Pair {
	t := ca.t
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber: serial(t),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
	}
	if usage == x509.ExtKeyUsageServerAuth {
		tmpl.DNSNames = dnsNames
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatalf("issue certificate %s: %v", name, err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatalf("marshal key: %v", err)
	}
	p := Pair{
		CertFile: writePEM(t, filepath.Join(ca.dir, name+".pem"), "CERTIFICATE", der),
		KeyFile:  writePEM(t, filepath.Join(ca.dir, name+"-key.pem"), "PRIVATE KEY", keyDER),
	}
	p.TLS, err = tls.LoadX509KeyPair(p.CertFile, p.KeyFile)
	if err != nil {
		t.Fatalf("load pair %s: %v", name, err)
	}
	return p
}

// ServerTLS is a server tls.Config presenting pair; with clientCA set it
// requires client certificates signed by clientCA.
func ServerTLS(pair Pair, clientCA *CA) *tls.Config {
	c := &tls.Config{Certificates: []tls.Certificate{pair.TLS}, MinVersion: tls.VersionTLS12}
	if clientCA != nil {
		c.ClientCAs = clientCA.Pool()
		c.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return c
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("generate key: %v", err)
	}
	return key
}

func serial(t testing.TB) *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatalf("serial: %v", err)
	}
	return n
}

func writePEM(t testing.TB, path, typ string, der []byte) string {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
	return path
}
