package nats

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/testing/servers"
)

// watermillFeatures are what this adapter honestly offers Watermill's
// universal suite.
func watermillFeatures() tests.Features {
	return tests.Features{
		ConsumerGroups: true,
		// At-least-once: a message neither acked nor nacked comes back after ack_wait.
		ExactlyOnceDelivery: false,
		// With consumer.subscribers = 1 a subscription holds one message at a
		// time and gets the next only after the ack, in stream order.
		GuaranteedOrder:                     true,
		GuaranteedOrderWithSingleSubscriber: true,
		Persistent:                          true,
		// Every subscriber belongs to a consumer group; a new subscriber of a
		// group continues from the group's position instead of re-reading
		// what the group has consumed.
		NewSubscriberReceivesOldMessages: false,
	}
}

// watermillConfig is the suite's config: a short ack_wait, because several
// suite tests close a subscriber with messages in flight and wait 15s for
// them, which come back only after ack_wait; and a short nak delay.
func watermillConfig(c *Config) {
	c.Consumer.AckWait = 3 * time.Second
	c.Consumer.NakDelay = 100 * time.Millisecond
}

// watermillGroup is the group of the suite's constructor without a group.
const watermillGroup = "watermill-suite"

func runWatermillSuite(t *testing.T, url string, features tests.Features) {
	runWatermillSuiteOn(t, url, features, func(b *Broker, group string) (message.Subscriber, error) {
		return b.Subscriber(adapters.SubscriberSpec{Group: group})
	})
}

func runWatermillSuiteOn(t *testing.T, url string, features tests.Features, newSubscriber func(b *Broker, group string) (message.Subscriber, error)) {
	constructor := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		b := openBroker(t, url, watermillConfig)
		sub, err := newSubscriber(b, group)
		require.NoError(t, err)
		return b.Publisher(), sub
	}
	tests.TestPubSub(t, features,
		func(t *testing.T) (message.Publisher, message.Subscriber) { return constructor(t, watermillGroup) },
		constructor,
	)
}

// TestWatermillSuite runs Watermill's universal Pub/Sub suite against the
// embedded server, the shared server (also on the
// ConcurrentRedeliverySubscriber that bus.Run gives an unordered handler, 16
// messages in flight, no order promised) and a private server process that
// the reconnect test kills and starts again.
func TestWatermillSuite(t *testing.T) {
	t.Parallel()
	t.Run("Embedded", func(t *testing.T) {
		t.Parallel()
		runWatermillSuite(t, servers.StartEmbeddedNATS(t).URL, watermillFeatures())
	})
	t.Run("Shared", func(t *testing.T) {
		t.Parallel()
		runWatermillSuite(t, sharedURL(), watermillFeatures())
	})
	t.Run("SharedConcurrent", func(t *testing.T) {
		t.Parallel()
		f := watermillFeatures()
		f.GuaranteedOrder, f.GuaranteedOrderWithSingleSubscriber = false, false
		runWatermillSuiteOn(t, sharedURL(), f, func(b *Broker, group string) (message.Subscriber, error) {
			return b.Subscriber(adapters.SubscriberSpec{Group: group, InFlight: 16, RedeliveryWait: func(int) time.Duration { return 10 * time.Millisecond }})
		})
	})
	t.Run("ServerProcess", func(t *testing.T) {
		t.Parallel()
		proc := servers.StartNATS(t)
		f := watermillFeatures()
		// Watermill's TestReconnect reads the list of published messages
		// while its publishing goroutine may still append to it, a data race
		// in the suite itself that fails every run under -race. It runs
		// without -race (go test -run TestWatermillSuite/ServerProcess).
		if !raceEnabled {
			f.RestartServiceCommand = proc.RestartCommand()
		}
		runWatermillSuite(t, proc.URL, f)
	})
}
