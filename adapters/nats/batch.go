package nats

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace-io/millrace/adapters"
)

// Error codes of the JetStream API that mean a message can never be stored.
const (
	codeMessageTooLarge = jetstream.JSErrCodeStreamMessageExceedsMaximum // over the stream's max_msg_size
	codeHeadersTooLarge = 10097                                          // header size exceeds maximum allowed of 64k
)

// errBrokerClosed is returned by calls on a closed Broker.
var errBrokerClosed = fmt.Errorf("nats: %w", adapters.ErrClosed)

// PublishBatch publishes msgs with JetStream's asynchronous publish, in slice
// order on one connection, each with Nats-Msg-Id set to msg.UUID, keeping at
// most broker.nats.publish.max_pending unconfirmed at once (across concurrent
// calls), and then waits for every confirm. It returns nil when all were
// confirmed (a message the server already had within the duplicate window
// counts as confirmed), else a *adapters.BatchError with one entry per
// message.
//
// A message over the size limit fails alone, permanently
// (adapters.ErrMessageTooLarge, the limit in the text). Any other failure
// stops the sending of the rest of the batch, which fail as not sent: a later
// message of the same aggregate must not be stored before an earlier one the
// relay will send again. Messages already in flight when a failure is seen
// may still be confirmed; see the README on ordering.
func (b *Broker) PublishBatch(ctx context.Context, msgs []adapters.Outgoing) error {
	if len(msgs) == 0 {
		return nil
	}
	if b.isClosed() {
		return adapters.FailAll(len(msgs), errBrokerClosed)
	}
	errs := make([]error, len(msgs))
	streamErr := b.ensureStreams(ctx, msgs)
	state := &batchState{}
	futures := make([]jetstream.PubAckFuture, len(msgs))
	var halt batchHalt
	for i, o := range msgs {
		if err := streamErr[o.Topic]; err != nil {
			errs[i] = err
			if !adapters.IsPermanent(err) {
				halt.stop(err)
			}
			continue
		}
		if halt.notSent == nil {
			if err := ctx.Err(); err != nil {
				halt.notSent = fmt.Errorf("nats: not sent: %w", err)
			} else if err := state.failure(); err != nil {
				halt.stop(err)
			}
		}
		if halt.notSent != nil {
			errs[i] = halt.notSent
			continue
		}
		futures[i], errs[i] = b.publishAsync(ctx, o, state, &halt)
	}
	b.waitConfirms(ctx, msgs, futures, errs)
	return adapters.NewBatchError(errs)
}

// ensureStreams returns, per topic of msgs, why its stream cannot take
// messages, or nil.
func (b *Broker) ensureStreams(ctx context.Context, msgs []adapters.Outgoing) map[string]error {
	streamErr := map[string]error{}
	for _, o := range msgs {
		if _, done := streamErr[o.Topic]; done {
			continue
		}
		if err := checkTopic(o.Topic); err != nil {
			streamErr[o.Topic] = adapters.Permanent(fmt.Errorf("nats: %w", err))
		} else {
			streamErr[o.Topic] = b.ensureStream(ctx, o.Topic)
		}
	}
	return streamErr
}

// batchHalt is why the rest of a batch is not sent.
type batchHalt struct {
	// notSent is the error of every message after the first retryable failure.
	notSent error
}

// stop makes the messages not sent yet fail because of cause, unless an
// earlier failure did already.
func (h *batchHalt) stop(cause error) {
	if h.notSent == nil {
		h.notSent = fmt.Errorf("nats: not sent because an earlier message of the batch failed: %w", cause)
	}
}

// publishAsync checks and sends o within the max_pending window and
// returns the future of its confirm, or its error; a failure the rest of
// the batch must not pass halts it.
func (b *Broker) publishAsync(ctx context.Context, o adapters.Outgoing, state *batchState, halt *batchHalt) (jetstream.PubAckFuture, error) {
	if err := b.rules.CheckMessage(o.Topic, o.Msg); err != nil {
		return nil, err // permanent: a header NATS refuses, or too large
	}
	nm, err := (marshaler{}).Marshal(o.Topic, o.Msg)
	if err != nil {
		return nil, err // permanent: a bad metadata key
	}
	if err := b.acquire(ctx); err != nil {
		halt.notSent = err
		return nil, err
	}
	// The slot may have been freed by a failed message: look again.
	if err := state.failure(); err != nil {
		b.release()
		halt.stop(err)
		return nil, halt.notSent
	}
	b.pending.Store(nm, state)
	f, err := b.js.PublishMsgAsync(nm,
		jetstream.WithMsgID(msgID(o.Msg.UUID)),
		// No automatic re-send on "no responders": it would re-send this
		// message after later ones. The relay retries the batch instead.
		jetstream.WithRetryAttempts(0),
	)
	if err != nil {
		if _, ok := b.pending.LoadAndDelete(nm); ok {
			b.release()
		}
		err = b.classify(o.Topic, o.Msg, nm, err)
		if !adapters.IsPermanent(err) {
			halt.stop(err)
		}
		return nil, err
	}
	return f, nil
}

// waitConfirms waits for the confirm of every message sent, until ctx
// ends, and puts the failures in errs.
func (b *Broker) waitConfirms(ctx context.Context, msgs []adapters.Outgoing, futures []jetstream.PubAckFuture, errs []error) {
	for i, f := range futures {
		if f == nil {
			continue
		}
		select {
		case <-f.Ok():
		case err := <-f.Err():
			errs[i] = b.classify(msgs[i].Topic, msgs[i].Msg, f.Msg(), err)
		case <-ctx.Done():
			errs[i] = fmt.Errorf("nats: gave up waiting for the confirm: %w", ctx.Err())
		}
	}
}

// batchState records the first retryable failure of a batch's in-flight
// messages, reported by the connection's async error handler, so sending
// stops early.
type batchState struct {
	mu  sync.Mutex
	err error
}

func (s *batchState) fail(err error) {
	s.mu.Lock()
	if s.err == nil {
		s.err = err
	}
	s.mu.Unlock()
}

func (s *batchState) failure() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// errWindowFull is wrapped when no in-flight slot frees up within
// publish.timeout.
var errWindowFull = errors.New("nats: too many unconfirmed messages")

// acquire takes one of the publish.max_pending in-flight slots. millrace
// keeps its own window rather than nats.go's max-pending option, so that a
// slot freed by a failed message is noticed before the next message goes out.
func (b *Broker) acquire(ctx context.Context) error {
	timer := time.NewTimer(b.cfg.Publish.Timeout)
	defer timer.Stop()
	select {
	case b.window <- struct{}{}:
		return nil
	case <-timer.C:
		return fmt.Errorf("%w: %d unconfirmed for %s", errWindowFull, b.cfg.Publish.MaxPending, b.cfg.Publish.Timeout)
	case <-ctx.Done():
		return fmt.Errorf("nats: not sent: %w", ctx.Err())
	}
}

func (b *Broker) release() { <-b.window }

// onAsyncAck is the JetStream context's handler for a confirmed message: it
// frees the message's in-flight slot.
func (b *Broker) onAsyncAck(_ jetstream.JetStream, nm *nats.Msg, _ *jetstream.PubAck) {
	if _, ok := b.pending.LoadAndDelete(nm); ok {
		b.release()
	}
}

// onAsyncError is the JetStream context's handler for a failed message: it
// frees the slot and tells the message's batch to stop sending, unless the
// message alone is at fault (too large).
func (b *Broker) onAsyncError(_ jetstream.JetStream, nm *nats.Msg, err error) {
	v, ok := b.pending.LoadAndDelete(nm)
	if !ok {
		return
	}
	// Record the failure before freeing the slot: the batch checks for
	// failures right after it gets a slot.
	if !adapters.IsPermanent(b.classify(nm.Subject, nil, nm, err)) {
		v.(*batchState).fail(err)
	}
	b.release()
}

// classify wraps a publish error: permanent when the message can never be
// stored as it is, retryable otherwise. msg may be nil.
func (b *Broker) classify(topic string, msg *message.Message, nm *nats.Msg, err error) error {
	id := ""
	if msg != nil {
		id = msg.UUID
	} else if nm != nil {
		id = nm.Header.Get(nats.MsgIdHdr)
	}
	if nm == nil && msg != nil {
		nm, _ = (marshaler{}).Marshal(topic, msg)
	}
	size := 0
	if nm != nil {
		size = nm.Size() - len(nm.Subject) - len(nm.Reply)
	}
	code := apiErrorCode(err)
	switch {
	case adapters.IsPermanent(err):
		return err
	case errors.Is(err, nats.ErrMaxPayload):
		return adapters.Permanent(fmt.Errorf("nats: message %s to topic %q: %w: %d bytes with headers, over the server's max_payload limit of %d bytes",
			id, topic, adapters.ErrMessageTooLarge, size, b.nc.MaxPayload()))
	case code == codeMessageTooLarge:
		limit := int64(b.cfg.Stream.MaxMsgSize)
		if limit == 0 {
			limit = b.nc.MaxPayload()
		}
		return adapters.Permanent(fmt.Errorf("nats: message %s to topic %q: %w: %d bytes with headers, over the stream's max_msg_size limit of %d bytes: %v",
			id, topic, adapters.ErrMessageTooLarge, size, limit, err))
	case code == codeHeadersTooLarge:
		return adapters.Permanent(fmt.Errorf("nats: message %s to topic %q: %w: headers over JetStream's limit of 65536 bytes: %v",
			id, topic, adapters.ErrMessageTooLarge, err))
	case errors.Is(err, jetstream.ErrNoStreamResponse), errors.Is(err, nats.ErrNoResponders):
		b.forgetStream(topic) // it may have been deleted: check it again next time
		return fmt.Errorf("nats: message %s to topic %q: no stream answered (missing, or no leader yet): %w", id, topic, err)
	default:
		return fmt.Errorf("nats: message %s to topic %q: %w", id, topic, err)
	}
}

// apiErrorCode is the JetStream API error code in err, from either nats.go
// API (the jetstream package's or the legacy one watermill-nats uses), or 0.
func apiErrorCode(err error) jetstream.ErrorCode {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		return apiErr.ErrorCode
	}
	var legacy *nats.APIError
	if errors.As(err, &legacy) {
		return jetstream.ErrorCode(legacy.ErrorCode)
	}
	return 0
}
