package nats

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain deletes the streams the tests made on the shared server and then
// checks that no goroutine outlived its Broker, subscriber or embedded server.
func TestMain(m *testing.M) {
	code := m.Run()
	deleteCreatedStreams()
	if code == 0 {
		// Watermill's TestReconnect never closes the channel its collecting
		// goroutine ranges over; that goroutine is the suite's, not ours.
		if err := goleak.Find(goleak.IgnoreTopFunction("github.com/ThreeDotsLabs/watermill/pubsub/tests.TestReconnect.func2")); err != nil {
			fmt.Fprintln(os.Stderr, "goroutines left behind:", err)
			code = 1
		}
	}
	os.Exit(code)
}
