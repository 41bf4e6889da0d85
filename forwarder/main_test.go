package forwarder_test

import (
	"os"
	"testing"
)

func TestMain(m *testing.M) {
	// The crash tests re-execute this test binary as a relay process.
	if os.Getenv(childEnv) != "" {
		os.Exit(runRelayChild())
	}
	os.Exit(m.Run())
}
