package rabbit

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a goroutine outlives the tests: every
// Broker, subscriber and connection must be gone once closed.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Watermill's TestReconnect never closes the channel this goroutine
		// of its own reads (pubsub/tests/test_pubsub.go:1085).
		goleak.IgnoreTopFunction("github.com/ThreeDotsLabs/watermill/pubsub/tests.TestReconnect.func2"),
	)
}
