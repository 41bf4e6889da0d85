package kafka

import (
	"fmt"

	"github.com/millrace-io/millrace/internal/confload"
)

// Config is the broker.kafka section of config.yaml.
type Config struct {
	// Brokers are the bootstrap broker addresses (host:port). Required when
	// broker.kind is kafka. KAFKA_BROKERS (comma separated) overrides it.
	Brokers []string `yaml:"brokers"`
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config { return c }

// Validate returns every problem in c, each naming its YAML path under path.
func (c Config) Validate(path string) []error {
	var chk confload.Checker
	if len(c.Brokers) == 0 {
		chk.Add(confload.Join(path, "brokers"), "required: at least one host:port")
	}
	for i, b := range c.Brokers {
		if b == "" {
			chk.Add(fmt.Sprintf("%s[%d]", confload.Join(path, "brokers"), i), "must not be empty")
		}
	}
	return chk.Problems
}
