package brokertest

import (
	"sync"
	"testing"
	"time"

	"github.com/millrace-io/millrace/adapters"
)

// Arrivals records when each message id first reached a consumer group,
// and how many deliveries there were in all (redeliveries too).
type Arrivals struct {
	mu    sync.Mutex
	first map[string]time.Time
	total int
}

// RecordArrivals subscribes group to topic on broker until the test ends
// and acks and records every delivery.
func RecordArrivals(t testing.TB, broker adapters.Broker, topic, group string) *Arrivals {
	t.Helper()
	ch := Subscribe(t, broker, topic, group)
	a := &Arrivals{first: map[string]time.Time{}}
	go func() {
		for m := range ch {
			now := time.Now()
			a.mu.Lock()
			if _, ok := a.first[m.UUID]; !ok {
				a.first[m.UUID] = now
			}
			a.total++
			a.mu.Unlock()
			m.Ack()
		}
	}()
	return a
}

// Distinct is how many message ids arrived.
func (a *Arrivals) Distinct() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.first)
}

// Total is how many deliveries arrived.
func (a *Arrivals) Total() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.total
}

// At is when id first arrived, and whether it did.
func (a *Arrivals) At(id string) (time.Time, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	at, ok := a.first[id]
	return at, ok
}
