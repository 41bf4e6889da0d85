package adapters_test

import (
	"crypto/tls"
	"fmt"

	"github.com/millrace-io/millrace/adapters"
)

// The tls block of a broker's section becomes a *tls.Config; without
// ca_file the system's roots verify the broker.
func ExampleTLSConfig_ClientConfig() {
	c := adapters.TLSConfig{Enabled: true, ServerName: "kafka.internal", MinVersion: adapters.TLS13}
	conf, err := c.WithDefaults().ClientConfig("broker.kafka.tls")
	if err != nil {
		panic(err)
	}
	fmt.Println(conf.ServerName, conf.MinVersion == tls.VersionTLS13, conf.RootCAs == nil)
	// Output: kafka.internal true true
}

// Settings given while TLS is off are an error naming the YAML path, so a
// config never talks plaintext by mistake.
func ExampleTLSConfig_Validate() {
	c := adapters.TLSConfig{CAFile: "/etc/millrace/ca.pem"}.WithDefaults()
	for _, err := range c.Validate("broker.kafka.tls", false) {
		fmt.Println(err)
	}
	// Output: broker.kafka.tls.enabled: TLS settings are given but TLS is off: set enabled: true
}
