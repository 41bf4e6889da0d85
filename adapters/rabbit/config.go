package rabbit

import "github.com/millrace-io/millrace/internal/confload"

// Config is the broker.rabbitmq section of config.yaml.
type Config struct {
	// URL is the AMQP URL, e.g. amqp://guest:guest@127.0.0.1:5672/. Required
	// when broker.kind is rabbitmq. AMQP_URL overrides it.
	URL string `yaml:"url"`
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config { return c }

// Validate returns every problem in c, each naming its YAML path under path.
func (c Config) Validate(path string) []error {
	var chk confload.Checker
	chk.URL(confload.Join(path, "url"), c.URL, "amqp", "amqps")
	return chk.Problems
}
