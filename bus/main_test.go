package bus_test

import (
	"os"
	"testing"

	"github.com/millrace-io/millrace/internal/testing/testkit/child"
)

func TestMain(m *testing.M) {
	// The saga crash test re-executes this test binary as a consumer process.
	if child.Role() == sagaChildRole {
		os.Exit(runSagaConsumerChild())
	}
	os.Exit(m.Run())
}
