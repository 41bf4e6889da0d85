package middleware

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// BatchHandlerFunc handles the messages of one batch together, in one
// inbox transaction: do the business writes of all of them in Tx(ctx) (a
// bulk insert, one call to another service for the batch). The messages are
// in delivery order, each with its inbox row already inserted in that
// transaction; duplicates (events the inbox has) and events the ordering
// guard finds stale never reach it.
//
// Returning nil commits the batch, and then acks its messages. Returning
// BatchFailures fails the messages it names: the transaction is rolled
// back, each named message goes the retry way (poisoned when its error is
// Permanent or its retries run out), and the others are handed over again
// at once in a later batch, without the failed ones, which commits them.
// Any other error fails the whole batch: every message of it is retried
// (poisoned when the error is Permanent). A panic rolls the batch back and
// every message of it is tried again in a batch of its own, so that the
// message that panics is found and retried alone, and the others commit.
//
// A batch holds the messages that reach the inbox stage within
// batch.max_wait of each other, up to batch.max_messages; with
// batch.max_messages 1, or with the inbox and the ordering guard both off,
// every batch holds one message. The context ends at the earliest
// handler_timeout of the batch's attempts.
type BatchHandlerFunc func(ctx context.Context, msgs []*message.Message) error

// BatchFailures is what a batch handler returns to fail some messages of
// its batch and not the others: the failed messages' event ids (EventID),
// each with its error. The error is treated as a handler's error for that
// message alone: retried, or poisoned when it is Permanent. A nil error
// fails nothing.
type BatchFailures map[string]error

// Error lists the failed event ids with their errors, sorted by id.
func (f BatchFailures) Error() string {
	ids := make([]string, 0, len(f))
	for id := range f {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	parts := make([]string, 0, len(ids))
	for _, id := range ids {
		parts = append(parts, fmt.Sprintf("%s: %v", id, f[id]))
	}
	return "batch handler failed " + fmt.Sprint(len(ids)) + " message(s): " + strings.Join(parts, "; ")
}

// UnknownBatchMessageError is the error every message of a batch gets when
// its batch handler returned BatchFailures naming an event id the batch does
// not hold: a bug in the handler, so the whole batch is rolled back and
// retried (and poisoned with this reason when retries run out).
type UnknownBatchMessageError struct {
	// EventID is the id the handler named (the smallest, when it named
	// several unknown ones).
	EventID string
	// BatchSize is the number of messages the handler was given.
	BatchSize int
}

func (e *UnknownBatchMessageError) Error() string {
	return fmt.Sprintf("batch handler returned a failure for event id %q, which is not one of the %d message(s) of its batch", e.EventID, e.BatchSize)
}

// EventID returns the event id the inbox deduplicates msg on, and the key
// of BatchFailures: the event-id header millrace sets or, for a message
// written by plain Watermill, its UUID.
func EventID(msg *message.Message) string { return eventIDOf(msg) }

// WrapBatch is Wrap for a batch handler: it returns the function to give
// router.AddConsumerHandler, which runs each delivery through the chain and
// hands the messages that reach the inbox stage together to h (see
// BatchHandlerFunc). Call Wrap or WrapBatch once per Chain.
func (c *Chain) WrapBatch(h BatchHandlerFunc) message.NoPublishHandlerFunc {
	if c.batcher != nil {
		c.batcher.handler = h
	}
	return c.Wrap(func(msg *message.Message) error {
		// A batch of one: with batching off, and for a message tried alone.
		return batchVerdicts([]string{eventIDOf(msg)}, h(msg.Context(), []*message.Message{msg}))[0]
	})
}

// batchVerdicts maps a batch handler's result onto the event ids of its
// batch: the i-th error is ids[i]'s, nil for a message that is to commit.
func batchVerdicts(ids []string, err error) []error {
	out := make([]error, len(ids))
	if err == nil {
		return out
	}
	var failures BatchFailures
	if !errors.As(err, &failures) {
		for i := range out {
			out[i] = err
		}
		return out
	}
	var unknown []string
	for id := range failures {
		if !slices.Contains(ids, id) {
			unknown = append(unknown, id)
		}
	}
	if len(unknown) > 0 {
		whole := &UnknownBatchMessageError{EventID: slices.Min(unknown), BatchSize: len(ids)}
		for i := range out {
			out[i] = whole
		}
		return out
	}
	for i, id := range ids {
		out[i] = failures[id]
	}
	return out
}

// batchCall is the outcome of one call of a batch handler.
type batchCall struct {
	err      error
	panicked bool
}

// callBatch calls the batch handler with the messages of todo, in ctx with
// tx in it, and reports what it did. A panic or a runtime.Goexit in the
// handler is reported, not raised: the batch's goroutine must settle every
// message.
func (b *batcher) callBatch(ctx context.Context, tx Transaction, todo []*member) (r batchCall) {
	defer b.c.activity.call()()
	// The handler gets copies, with tx in their contexts as a handler's
	// message has: a member released at the deadline may run alone while a
	// handler that ignores its context still reads them.
	msgs := make([]*message.Message, len(todo))
	for i, m := range todo {
		msgs[i] = m.in.msg.Copy()
		msgs[i].SetContext(withHandling(m.in.msg.Context(), tx, m.in.a.number))
	}
	returned := false
	defer func() {
		if !returned {
			r.panicked = true
			if p := recover(); p != nil {
				r.err = fmt.Errorf("panic in the batch handler: %v\n%s", p, debug.Stack())
			} else {
				r.err = errors.New("the batch handler ended its goroutine")
			}
		}
	}()
	r.err = b.handler(withHandling(ctx, tx, 0), msgs)
	returned = true
	return r
}

// runHandler is the batch handler's part of execute: it calls the handler
// with the members whose step let them through (outcome ok), and returns
// true when the transaction is to commit. Otherwise it has rolled tx back
// and given every kept member its verdict.
func (b *batcher) runHandler(ctx context.Context, tx Transaction, kept []*member) bool {
	var todo []*member
	for _, m := range kept {
		if m.outcome == OutcomeOK {
			todo = append(todo, m)
		}
	}
	if len(todo) == 0 {
		return true
	}
	called := make(chan batchCall, 1)
	go func() { called <- b.callBatch(ctx, tx, todo) }()
	var r batchCall
	select {
	case r = <-called:
	case <-ctx.Done():
		// As in execute: the members go now, with nothing committed, and
		// tx is rolled back once the handler has returned.
		for _, m := range kept {
			m.done <- errRunAlone
		}
		<-called
		_ = tx.Rollback()
		return false
	}
	if r.err == nil {
		return true
	}
	if r.panicked {
		// Which message made it panic is unknown: each is tried alone.
		b.c.stack.logger.Error("Batch handler panicked; its batch is rolled back and each message tried in a batch of its own", r.err,
			watermill.LogFields{"handler": b.c.spec.Name, "topic": b.c.spec.Topic, "consumer_group": b.c.spec.ConsumerGroup, "batch_size": len(todo)})
		_ = tx.Rollback()
		for _, m := range kept {
			m.done <- errRunAlone
		}
		return false
	}
	ids := make([]string, len(todo))
	for i, m := range todo {
		ids[i] = m.eventID
	}
	verdicts := batchVerdicts(ids, r.err)
	if !slices.ContainsFunc(verdicts, func(err error) bool { return err != nil }) {
		return true // failures with nil errors only: nothing failed
	}
	var failures BatchFailures
	if !errors.As(r.err, &failures) && IsRetryable(r.err) {
		// Did the whole batch fail because the database went away? Its
		// transaction answers unless the connection is gone.
		if _, probe := tx.ExecContext(ctx, "SELECT 1"); unreachable(probe) {
			for i := range verdicts {
				verdicts[i] = &unavailableError{err: r.err}
			}
		}
	}
	_ = tx.Rollback()
	judged := make(map[*member]error, len(todo))
	for i, m := range todo {
		if verdicts[i] != nil {
			judged[m] = verdicts[i]
		}
	}
	for _, m := range kept {
		if err, ok := judged[m]; ok {
			m.done <- err
		} else {
			m.done <- errBatchAborted // not judged: handed over again
		}
	}
	return false
}

// executeBulk is the short way of a batch handler's batch whose inbox rows
// inboxAll inserted: no turn (and no savepoint) per member, the handler at
// once, then the COMMIT.
func (b *batcher) executeBulk(ctx context.Context, tx Transaction, members []*member) {
	for _, m := range members {
		m.outcome = OutcomeOK
	}
	if b.runHandler(ctx, tx, members) {
		b.commit(ctx, tx, members)
	}
}
