package forwarder_test

import (
	"os"
	"testing"

	"github.com/millrace-io/millrace/internal/testing/testkit/child"
)

func TestMain(m *testing.M) {
	// The crash tests re-execute this test binary as a relay process.
	if child.Role() == relayRole {
		os.Exit(runRelayChild())
	}
	os.Exit(m.Run())
}
