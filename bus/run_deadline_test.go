package bus_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// deadlineCtx is a context whose deadline passes when the test calls
// expire, not at a time a slow machine might reach before Run is up: its
// Err is then context.DeadlineExceeded, as a context.WithDeadline's is,
// and every context derived from it ends the same way.
type deadlineCtx struct {
	context.Context
	done chan struct{}
	once sync.Once
}

func newDeadlineCtx() *deadlineCtx {
	return &deadlineCtx{Context: context.Background(), done: make(chan struct{})}
}

func (c *deadlineCtx) expire()               { c.once.Do(func() { close(c.done) }) }
func (c *deadlineCtx) Done() <-chan struct{} { return c.done }

func (c *deadlineCtx) Err() error {
	select {
	case <-c.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}

// A deadline ends Run as a cancellation does: a graceful stop, and nil.
func TestRunReturnsNilAtItsDeadline(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	svc := brokertest.NewService(t, bus.KindNATS)
	suffix := testdb.UniqueName("")[2:]
	topic, handler := "orders-"+suffix, "billing-"+suffix
	brokertest.Cleanup(t, bus.KindNATS, topic, handler)
	b := svc.Open(t)
	handled := make(chan struct{}, 1)
	require.NoError(t, b.Handle(topic, handler, func(context.Context, bus.Event) error {
		select {
		case handled <- struct{}{}:
		default:
		}
		return nil
	}))

	runCtx := newDeadlineCtx()
	defer runCtx.expire()
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	require.NoError(t, b.PublishInOwnTx(ctx, topic, orderCreated("o-1")))
	select {
	case <-handled: // the relay and the handler are running
	case err := <-done:
		t.Fatalf("Run returned before its deadline: %v", err)
	case <-time.After(time.Minute):
		t.Fatal("the event never reached the handler")
	}
	runCtx.expire()
	require.ErrorIs(t, runCtx.Err(), context.DeadlineExceeded)
	require.NoError(t, <-done, "a deadline is a clean stop")
}
