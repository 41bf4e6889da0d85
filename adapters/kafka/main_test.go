package kafka_test

import (
	"os"
	"testing"
)

// TestMain runs the test binary as a dev cluster process when a crash test
// re-executes it for that (see startClusterProcess), else runs the tests.
func TestMain(m *testing.M) {
	if os.Getenv(clusterChildDirEnv) != "" {
		os.Exit(runClusterChild())
	}
	os.Exit(m.Run())
}
