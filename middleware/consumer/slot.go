package consumer

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// workerSlot is a released message's hold on one of its Dispatcher's
// workers: the middleware.Worker of its Lease. A message that waits after a failed attempt (the retry stage's
// backoff in process, the breaker while it is open) gives its worker back
// meanwhile (pause) and takes one again before its next attempt (resume),
// so that the messages behind it are not held back by one that keeps
// failing or hanging: workers bounds the attempts running at once, and
// consumer.prefetch the messages held in all. A paused message keeps its
// place otherwise: in ordered mode the later messages of its aggregate
// still wait for it. Only the Dispatcher's scheduler goroutine touches the
// fields.
type workerSlot struct {
	d *Dispatcher
	// delivery is the broker's delivery number of the message (see
	// middleware.Lease), set before the slot is shared.
	delivery int
	paused   bool // waiting off its worker
	finished bool // acked or nacked
}

// slotRequest asks the scheduler to pause a slot (grant nil) or to resume
// it, closing grant once a worker is free.
type slotRequest struct {
	slot  *workerSlot
	grant chan struct{}
}

// Pause gives the slot's worker to the next message.
func (w *workerSlot) Pause() {
	select {
	case w.d.slots <- slotRequest{slot: w}:
	case <-w.d.finished: // the Dispatcher has stopped: nothing to give back
	}
}

// Resume returns once the message holds a worker again, or ctx ended. The
// paused messages take free workers before any new message does.
func (w *workerSlot) Resume(ctx context.Context) error {
	grant := make(chan struct{})
	select {
	case w.d.slots <- slotRequest{slot: w, grant: grant}:
	case <-w.d.finished:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	select {
	case <-grant:
		return nil
	case <-w.d.finished:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// onSlotRequest applies req in the scheduler goroutine.
func (s *schedule) onSlotRequest(req slotRequest) {
	w := req.slot
	switch {
	case req.grant == nil:
		if !w.paused && !w.finished {
			w.paused = true
			s.paused++
		}
	case !w.paused || w.finished:
		close(req.grant)
	default:
		s.resumers = append(s.resumers, req)
	}
	s.grantResumers()
}

// grantResumers gives free workers to the paused messages waiting for one,
// in the order they asked.
func (s *schedule) grantResumers() {
	for len(s.resumers) > 0 && s.working() < s.workers {
		req := s.resumers[0]
		s.resumers[0] = slotRequest{}
		s.resumers = s.resumers[1:]
		if req.slot.paused && !req.slot.finished {
			req.slot.paused = false
			s.paused--
		}
		close(req.grant)
	}
}

// releaseSlot accounts for msg's slot when msg is acked or nacked.
func (s *schedule) releaseSlot(msg *message.Message) {
	v, ok := s.workerSlots.LoadAndDelete(msg)
	if !ok {
		return
	}
	w := v.(*workerSlot)
	if w.paused {
		w.paused = false
		s.paused--
	}
	w.finished = true
}
