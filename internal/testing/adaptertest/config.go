package adaptertest

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// ShippedSection returns the YAML of the section broker.<key> of the
// shipped config.yaml, read from the module root two folders above the
// test's package (adapters/<kind>), for the test to decode.
func ShippedSection(t testing.TB, key string) []byte {
	t.Helper()
	data, err := os.ReadFile("../../config.yaml")
	require.NoError(t, err)
	var doc struct {
		Broker map[string]yaml.Node `yaml:"broker"`
	}
	require.NoError(t, yaml.Unmarshal(data, &doc))
	node, ok := doc.Broker[key]
	require.True(t, ok, "config.yaml has no broker.%s", key)
	section, err := yaml.Marshal(&node)
	require.NoError(t, err)
	return section
}
