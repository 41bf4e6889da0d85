package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/adaptertest"
	"github.com/millrace-io/millrace/adapters/kafka"
)

// TestCloseLeavesNoGoroutines: after Close of its subscribers (stock,
// ordered and concurrent), Broker and
// dev cluster, nothing they started keeps running. Not parallel, so the
// goroutines of other tests do not count.
func TestCloseLeavesNoGoroutines(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(),
		// go-metrics, which Sarama uses, runs one process-wide meter ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"))

	b, err := kafka.Open(context.Background(), kafka.Config{
		Brokers: []string{"127.0.0.1:0"}, DevCluster: true, HeartbeatInterval: 500 * time.Millisecond,
	}, adapters.Options{ConnectTimeout: 30 * time.Second})
	require.NoError(t, err)
	topic := adaptertest.Name("leak")
	subscribers := map[string]func(group string) (message.Subscriber, error){
		"stock":      b.Subscriber,
		"ordered":    func(g string) (message.Subscriber, error) { return b.OrderedSubscriber(g, 8) },
		"concurrent": func(g string) (message.Subscriber, error) { return b.ConcurrentSubscriber(g, 8) },
	}
	var chans []<-chan *message.Message
	for _, newSub := range subscribers {
		sub, err := newSub(adaptertest.Name("g"))
		require.NoError(t, err)
		ch, err := sub.Subscribe(context.Background(), topic)
		require.NoError(t, err)
		chans = append(chans, ch)
	}
	require.NoError(t, b.Publisher().Publish(topic, message.NewMessage("m-1", []byte(`{}`))))
	for _, ch := range chans {
		select {
		case m := <-ch:
			m.Ack()
		case <-time.After(60 * time.Second):
			require.FailNow(t, "message never arrived")
		}
	}
	require.NoError(t, b.Close())
	for _, ch := range chans {
		_, open := <-ch
		require.False(t, open, "Close closes the subscription channels")
	}
}
