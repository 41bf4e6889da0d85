package kafka

import (
	"context"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// securityOptions are the franz-go client's TLS and SASL settings from
// broker.kafka.tls and broker.kafka.sasl.
func securityOptions(cfg Config) ([]kgo.Opt, error) {
	var opts []kgo.Opt
	if cfg.TLS.Enabled {
		tc, err := cfg.TLS.ClientConfig("broker.kafka.tls")
		if err != nil {
			return nil, err
		}
		opts = append(opts, kgo.DialTLSConfig(tc))
	}
	user, password := cfg.SASL.User, cfg.SASL.Password
	switch cfg.SASL.Mechanism {
	case SASLPlain:
		opts = append(opts, kgo.SASL(plain.Auth{User: user, Pass: password}.AsMechanism()))
	case SASLScramSHA256:
		opts = append(opts, kgo.SASL(scram.Auth{User: user, Pass: password}.AsSha256Mechanism()))
	case SASLScramSHA512:
		opts = append(opts, kgo.SASL(scram.Auth{User: user, Pass: password}.AsSha512Mechanism()))
	}
	return opts, nil
}

// applySecurity sets TLS and SASL on the subscribers' Sarama config from
// broker.kafka.tls and broker.kafka.sasl.
func applySecurity(c *sarama.Config, cfg Config) error {
	if cfg.TLS.Enabled {
		tc, err := cfg.TLS.ClientConfig("broker.kafka.tls")
		if err != nil {
			return err
		}
		c.Net.TLS.Enable = true
		c.Net.TLS.Config = tc
	}
	if cfg.SASL.Mechanism == "" {
		return nil
	}
	c.Net.SASL.Enable = true
	c.Net.SASL.Handshake = true
	c.Net.SASL.User = cfg.SASL.User
	c.Net.SASL.Password = cfg.SASL.Password
	switch cfg.SASL.Mechanism {
	case SASLPlain:
		c.Net.SASL.Mechanism = sarama.SASLTypePlaintext
	case SASLScramSHA256:
		c.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA256
		c.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient {
			return &scramClient{mechanism: func(a scram.Auth) sasl.Mechanism { return a.AsSha256Mechanism() }}
		}
	case SASLScramSHA512:
		c.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA512
		c.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient {
			return &scramClient{mechanism: func(a scram.Auth) sasl.Mechanism { return a.AsSha512Mechanism() }}
		}
	}
	return nil
}

// scramClient runs a SCRAM exchange for Sarama (which leaves the SCRAM
// implementation to the caller) with franz-go's SCRAM client, a module
// millrace already depends on for its dev cluster.
type scramClient struct {
	mechanism func(scram.Auth) sasl.Mechanism
	session   sasl.Session
	first     []byte // the client-first message, until Step("") sends it
	done      bool
}

// Begin starts the exchange for user and password.
func (s *scramClient) Begin(user, password, authzID string) error {
	session, first, err := s.mechanism(scram.Auth{User: user, Pass: password, Zid: authzID}).
		Authenticate(context.Background(), "")
	if err != nil {
		return err
	}
	s.session, s.first = session, first
	return nil
}

// Step answers the server's challenge; the first call (with "") returns
// the client-first message.
func (s *scramClient) Step(challenge string) (string, error) {
	if s.first != nil {
		first := s.first
		s.first = nil
		return string(first), nil
	}
	done, response, err := s.session.Challenge([]byte(challenge))
	if err != nil {
		return "", err
	}
	s.done = done
	return string(response), nil
}

// Done reports whether the server's final message was verified.
func (s *scramClient) Done() bool { return s.done }
