package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka"
	"github.com/millrace-io/millrace/internal/testing/adaptertest"
)

// TestCloseLeavesNoGoroutines: after Close of its subscribers (stock,
// ordered, concurrent and with retry topics, one of whose messages is
// parked), Broker and dev cluster, nothing they started keeps running. Not
// parallel, so the goroutines of other tests do not count.
func TestCloseLeavesNoGoroutines(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(),
		// go-metrics, which Sarama uses, runs one process-wide meter ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"))

	b, err := kafka.Open(context.Background(), kafka.Config{
		Brokers: []string{"127.0.0.1:0"}, DevCluster: true, HeartbeatInterval: 500 * time.Millisecond, RetryTopics: true,
	}, adapters.Options{ConnectTimeout: 30 * time.Second})
	require.NoError(t, err)
	topic := adaptertest.Name("leak")
	subscribers := map[string]func(group string) (message.Subscriber, error){
		"stock": func(g string) (message.Subscriber, error) {
			return b.Subscriber(adapters.SubscriberSpec{Group: g})
		},
		"ordered": func(g string) (message.Subscriber, error) {
			return b.Subscriber(adapters.SubscriberSpec{Group: g, Ordered: true, InFlight: 8})
		},
		"concurrent": func(g string) (message.Subscriber, error) {
			return b.Subscriber(adapters.SubscriberSpec{Group: g, InFlight: 8})
		},
		"redelivery": func(g string) (message.Subscriber, error) {
			return b.Subscriber(adapters.SubscriberSpec{Group: g, InFlight: 8, RedeliveryWait: func(int) time.Duration { return time.Hour }})
		},
	}
	chans := map[string]<-chan *message.Message{}
	for name, newSub := range subscribers {
		sub, err := newSub(adaptertest.Name("g"))
		require.NoError(t, err)
		ch, err := sub.Subscribe(context.Background(), topic)
		require.NoError(t, err)
		chans[name] = ch
	}
	require.NoError(t, b.Publisher().Publish(topic, message.NewMessage("m-1", []byte(`{}`))))
	for name, ch := range chans {
		m := adaptertest.Next(t, ch, time.Minute)
		if name == "redelivery" {
			m.Nack()
		} else {
			m.Ack()
		}
	}
	require.NoError(t, b.Close())
	for _, ch := range chans {
		_, open := <-ch
		require.False(t, open, "Close closes the subscription channels")
	}
}
