package millracetest

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/bus"
)

// OutcomeCrashed is the outcome of a delivery whose process died before the
// chain returned: nothing was acked, the handler's transaction rolled back.
// The chain's own outcomes are middleware.OutcomeOK, OutcomeDuplicate,
// OutcomeStale, OutcomePoisoned and OutcomeNacked.
const OutcomeCrashed = "crashed"

// Delivery is one delivery of an event to a consumer process, as the
// harness made it and as the chain reported it.
type Delivery struct {
	// EventID is the delivered event's id.
	EventID string
	// N counts the deliveries of this event: 1 for the first.
	N int
	// Pattern is the Harness method that made the delivery, e.g. "CrashBeforeCommit".
	Pattern string
	// Step says what this delivery is within the pattern.
	Step string
	// Process numbers the consumer process that received it; a crash
	// starts a new one.
	Process int
	// Outcome is how the chain ended the delivery (its
	// millrace_consumer_messages_total outcome: middleware.OutcomeOK,
	// OutcomeDuplicate, OutcomeStale, OutcomePoisoned, OutcomeNacked), or
	// OutcomeCrashed.
	Outcome string
	// HandlerRuns counts the calls of the handler during this delivery,
	// retries included; 0 when the chain acked it without calling the
	// handler (a duplicate, a stale version, an invalid message).
	HandlerRuns int
	// Retries counts the failed attempts the chain retried.
	Retries int
	// Acked says the consumer acked the delivery: the chain returned nil
	// and the ack reached the broker (not lost in a crash).
	Acked bool
	// Err is the chain's error when it nacked the delivery.
	Err string
}

// String describes d in one line.
func (d Delivery) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "delivery %d (%s, process %d: %s): %s, handler ran %d %s",
		d.N, d.Pattern, d.Process, d.Step, d.Outcome, d.HandlerRuns, plural(d.HandlerRuns, "time", "times"))
	if d.Retries > 0 {
		fmt.Fprintf(&b, ", %d %s", d.Retries, plural(d.Retries, "retry", "retries"))
	}
	switch {
	case d.Acked:
		b.WriteString(", acked")
	case d.Err != "":
		fmt.Fprintf(&b, ", nacked: %s", d.Err)
	default:
		b.WriteString(", not acked")
	}
	return b.String()
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// Deliver delivers each event once, in order, to the current consumer
// process, and again while the chain nacks it (as a broker redelivers a
// nacked message). It returns the events as the handler received them, ids
// assigned: pass them to the other methods to deliver the same events again.
func (h *Harness) Deliver(evs ...bus.Event) []bus.Event {
	h.t.Helper()
	if len(evs) == 0 {
		return nil
	}
	msgs, delivered := h.prepare(evs)
	for _, msg := range msgs {
		h.untilAcked(msg, "Deliver", "delivered")
	}
	return delivered
}

// DeliverTwice delivers ev, and once it is acked delivers the same message
// again: the duplicate a relay that crashed before recording its progress,
// or a broker redelivering after a lost ack, puts in the stream. With the
// inbox on, the second delivery is a duplicate and the handler does not run.
func (h *Harness) DeliverTwice(ev bus.Event) bus.Event {
	h.t.Helper()
	return h.once(ev, func(msg *message.Message) {
		h.t.Helper()
		h.untilAcked(msg, "DeliverTwice", "first copy")
		h.untilAcked(msg, "DeliverTwice", "second copy")
	})
}

// CrashAfterEffectBeforeAck delivers ev; the chain runs the handler and
// commits its transaction (the inbox row and the business effect), then the
// process dies before the ack reaches the broker. The broker delivers ev
// again, to a restarted consumer process. With the inbox on, that
// redelivery is a duplicate and the handler does not run again.
func (h *Harness) CrashAfterEffectBeforeAck(ev bus.Event) bus.Event {
	h.t.Helper()
	return h.faulty(ev, "CrashAfterEffectBeforeAck", "the chain returns, then the process dies before the ack", deliverOpts{loseAck: true})
}

// CrashBeforeCommit delivers ev; the handler runs to its end (whatever it
// returns), then the process dies before the chain commits or retries. The
// handler's transaction rolls back, inbox row and all, and the broker
// delivers ev again to a restarted consumer process, where the handler runs
// again. Whatever the handler did outside bus.Tx in the first run (a
// write on its own connection, a call to another service) is not rolled
// back: this is the pattern that shows it.
//
// When the chain acks ev without calling the handler (a duplicate, a stale
// version, an invalid message), there is nothing to crash in: the delivery
// is recorded as the chain ended it.
func (h *Harness) CrashBeforeCommit(ev bus.Event) bus.Event {
	h.t.Helper()
	return h.faulty(ev, "CrashBeforeCommit", "the process dies when the handler returns, before the commit", deliverOpts{crash: true})
}

// FailCommitOnce delivers ev; after the handler's first successful run the
// commit of its transaction fails (the harness aborts the transaction, so
// PostgreSQL rolls it back at COMMIT, as with a serialization failure or a
// connection lost at commit). The chain rolls back and retries in the same
// process, and the handler runs again. Like CrashBeforeCommit, it shows
// effects made outside bus.Tx, here without a crash.
func (h *Harness) FailCommitOnce(ev bus.Event) bus.Event {
	h.t.Helper()
	return h.faulty(ev, "FailCommitOnce", "the first commit fails and the chain retries", deliverOpts{failCommit: true})
}

// DeliverConcurrently delivers ev to copies consumer processes at the same
// time: the current one and copies-1 others, as when a broker hands a
// message whose ack is late (NATS AckWait, a RabbitMQ channel that dropped)
// to another instance while the first still works on it. With the inbox on,
// one of them runs the handler and the others, waiting on its inbox row,
// find a duplicate. copies must be at least 2.
func (h *Harness) DeliverConcurrently(ev bus.Event, copies int) bus.Event {
	h.t.Helper()
	if copies < 2 {
		h.t.Fatalf("millracetest: DeliverConcurrently: copies must be at least 2; got %d", copies)
		return bus.Event{}
	}
	return h.once(ev, func(msg *message.Message) {
		h.t.Helper()
		procs := []*process{h.current}
		ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
		defer cancel()
		for range copies - 1 {
			p, err := h.newProcess(ctx)
			if err != nil {
				h.t.Fatalf("millracetest: DeliverConcurrently: start a consumer process: %v", err)
				return
			}
			procs = append(procs, p)
		}
		results := make([]Delivery, len(procs))
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, p := range procs {
			wg.Go(func() {
				<-start
				results[i] = h.deliver(p, msg, "DeliverConcurrently", fmt.Sprintf("copy %d of %d, at the same time", i+1, copies), deliverOpts{})
			})
		}
		close(start)
		wg.Wait()
		for _, p := range procs[1:] {
			p.bus.Close()
		}
		if slices.ContainsFunc(results, func(d Delivery) bool { return !d.Acked }) &&
			!slices.ContainsFunc(results, func(d Delivery) bool { return d.Acked }) {
			h.untilAcked(msg, "DeliverConcurrently", "redelivered after a nack")
		}
	})
}

// once prepares ev, runs a pattern's deliveries of it and returns it as
// the handler received it, id assigned.
func (h *Harness) once(ev bus.Event, deliveries func(msg *message.Message)) bus.Event {
	h.t.Helper()
	msg, delivered := h.prepareOne(ev)
	if msg == nil {
		return bus.Event{}
	}
	deliveries(msg)
	return delivered
}

// faulty delivers ev once with the fault o injects, then again until it is
// acked: to a restarted process when the first one died (it lost the ack,
// or crashed in the handler), else after a nack. It returns ev as the
// handler received it, id assigned.
func (h *Harness) faulty(ev bus.Event, pattern, step string, o deliverOpts) bus.Event {
	h.t.Helper()
	return h.once(ev, func(msg *message.Message) {
		h.t.Helper()
		d := h.deliver(h.current, msg, pattern, step, o)
		switch {
		case o.loseAck || d.Outcome == OutcomeCrashed:
			h.restart()
			h.untilAcked(msg, pattern, "redelivered to the restarted process")
		case !d.Acked:
			h.untilAcked(msg, pattern, "redelivered after a nack")
		}
	})
}

// Reorder delivers evs in the opposite order to the one given (and
// published in): the broker or a redelivery put a later event first.
// Give events of one aggregate with increasing AggregateVersion: with
// consumer.ordering_guard on, an event older than the version already
// applied is dropped as stale (the handler does not run); with it off, the
// handler applies it after the newer one. It returns the events in the order
// given, ids assigned.
func (h *Harness) Reorder(evs ...bus.Event) []bus.Event {
	h.t.Helper()
	if len(evs) < 2 {
		h.t.Fatalf("millracetest: Reorder needs at least 2 events; got %d", len(evs))
		return nil
	}
	msgs, delivered := h.prepare(evs)
	for i := len(msgs) - 1; i >= 0; i-- {
		h.untilAcked(msgs[i], "Reorder", fmt.Sprintf("event %d of %d, delivered in position %d", i+1, len(msgs), len(msgs)-i))
	}
	return delivered
}
