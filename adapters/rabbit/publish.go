package rabbit

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/millrace-io/millrace/adapters"
)

// publishWindow bounds the messages in flight (published, not yet confirmed)
// on one channel. It also sizes the channel's buffer of returned messages,
// which must never fill: amqp091 gives up on a notification that cannot be
// delivered within 5s, and a lost basic.return would make an unroutable
// message look confirmed.
const publishWindow = 1024

// maxIdleChannels is how many confirm-mode channels the Broker keeps open
// between PublishBatch calls (one per concurrent caller is used at a time).
const maxIdleChannels = 16

// Errors wrapped by PublishBatch's per-message errors. All are retryable.
var (
	// ErrUnroutable: the broker returned the message (basic.return) because
	// no queue, not even the topic's parking queue for unroutable messages,
	// was bound. The topic's topology is declared again on the next call.
	ErrUnroutable = errors.New("rabbitmq: message returned unroutable")
	// ErrNacked: the broker refused the message with basic.nack (an internal
	// error, or a queue at its length limit with x-overflow reject-publish).
	ErrNacked = errors.New("rabbitmq: broker did not accept the message (basic.nack)")
	// ErrBlocked: the broker blocks this connection's publishers because of
	// a resource alarm (memory or disk); nothing was sent.
	ErrBlocked = errors.New("rabbitmq: broker is blocking publishers")
)

// confirmChannel is a channel in confirm mode with its listeners.
type confirmChannel struct {
	conn    *amqp.Connection
	ch      *amqp.Channel
	returns chan amqp.Return
	closes  chan *amqp.Error
	closed  *amqp.Error // the close reason, once read from closes
}

// closeReason returns why the channel closed, or nil while it is open.
func (cc *confirmChannel) closeReason() error {
	if cc.closed == nil {
		select {
		case e, ok := <-cc.closes:
			if ok && e != nil {
				cc.closed = e
			}
		default:
		}
	}
	if cc.closed != nil {
		return cc.closed
	}
	if cc.ch.IsClosed() {
		return amqp.ErrClosed
	}
	return nil
}

// takeChannel returns an idle confirm-mode channel of conn or opens one.
func (b *Broker) takeChannel(conn *amqp.Connection) (*confirmChannel, error) {
	b.mu.Lock()
	if b.blocked != "" && b.conn == conn {
		reason := b.blocked
		b.mu.Unlock()
		return nil, fmt.Errorf("%w (%s); publishing resumes when the alarm on %s clears", ErrBlocked, reason, b.redacted)
	}
	for len(b.idle) > 0 {
		cc := b.idle[len(b.idle)-1]
		b.idle = b.idle[:len(b.idle)-1]
		if cc.conn == conn && cc.closeReason() == nil {
			b.mu.Unlock()
			return cc, nil
		}
	}
	b.mu.Unlock()

	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: open channel on %s: %w", b.redacted, err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("rabbitmq: enable publisher confirms on %s: %w", b.redacted, err)
	}
	return &confirmChannel{
		conn:    conn,
		ch:      ch,
		returns: ch.NotifyReturn(make(chan amqp.Return, 2*publishWindow)),
		closes:  ch.NotifyClose(make(chan *amqp.Error, 1)),
	}, nil
}

// putChannel keeps a healthy channel for the next call, or closes it.
func (b *Broker) putChannel(cc *confirmChannel) {
	b.mu.Lock()
	if !b.closed && cc.conn == b.conn && cc.closeReason() == nil && len(b.idle) < maxIdleChannels {
		b.idle = append(b.idle, cc)
		b.mu.Unlock()
		return
	}
	b.mu.Unlock()
	_ = cc.ch.Close()
}

// forgetTopics makes the next call declare every topic's topology again.
func (b *Broker) forgetTopics(conn *amqp.Connection) {
	b.mu.Lock()
	if b.conn == conn {
		clear(b.declared)
	}
	b.mu.Unlock()
}

// ensureTopics declares the publishing topology of every topic not yet
// declared on conn and returns the error of each topic that failed.
func (b *Broker) ensureTopics(conn *amqp.Connection, topics []string) map[string]error {
	errs := map[string]error{}
	tc := &topoChannel{conn: conn}
	defer tc.close()
	for _, topic := range topics {
		b.mu.Lock()
		done := b.conn == conn && b.declared[topic]
		b.mu.Unlock()
		if done {
			continue
		}
		if err := b.declarer.declareTopic(tc, topic); err != nil {
			errs[topic] = err
			continue
		}
		b.mu.Lock()
		if b.conn == conn {
			b.declared[topic] = true
		}
		b.mu.Unlock()
	}
	return errs
}

// PublishBatch publishes msgs in slice order on one confirm-mode channel,
// pipelined (up to 1024 unconfirmed at a time), as persistent, mandatory
// publishes, and waits for every confirm. It returns nil when the broker
// confirmed all of them, else a *adapters.BatchError with one error per
// message (nil = confirmed):
//
//   - a body over Config.MaxMessageBytes, a bad topic name or a topology
//     conflict on the topic: permanent, the rest of the batch still goes out;
//   - nack, basic.return, a lost channel or connection, ctx ending: retryable.
//
// A topic's exchange, alternate exchange and parking queue are declared on
// first use, so a message published before any consumer group's queue exists
// is parked in UnroutedQueueName(topic), not dropped. A later call after the
// connection was lost reconnects.
func (b *Broker) PublishBatch(ctx context.Context, msgs []adapters.Outgoing) error {
	if len(msgs) == 0 {
		return nil
	}
	errs := make([]error, len(msgs))
	pubs := make([]amqp.Publishing, len(msgs))
	var topics []string
	seen := map[string]bool{}
	for i, o := range msgs {
		if errs[i] = b.prepare(o, &pubs[i]); errs[i] != nil {
			continue
		}
		if !seen[o.Topic] {
			seen[o.Topic] = true
			topics = append(topics, o.Topic)
		}
	}
	if len(topics) == 0 {
		return adapters.NewBatchError(errs)
	}

	conn, err := b.connection(ctx)
	if err != nil {
		failUnsent(errs, err)
		return adapters.NewBatchError(errs)
	}
	defer b.dropOnCancel(ctx, conn)()
	checkHeaderFrames(conn, msgs, pubs, errs)
	cc, err := b.takeChannel(conn)
	if err != nil {
		failUnsent(errs, err)
		return adapters.NewBatchError(errs)
	}
	for topic, err := range b.ensureTopics(cc.conn, topics) {
		for i, o := range msgs {
			if errs[i] == nil && o.Topic == topic {
				errs[i] = err
			}
		}
	}
	if b.publishOn(ctx, cc, msgs, pubs, errs) {
		b.putChannel(cc)
	} else {
		_ = cc.ch.Close()
		b.forgetTopics(cc.conn)
	}
	return adapters.NewBatchError(errs)
}

// prepare checks one message and marshals it into p.
func (b *Broker) prepare(o adapters.Outgoing, p *amqp.Publishing) error {
	if o.Msg == nil {
		return adapters.Permanent(errors.New("rabbitmq: nil message"))
	}
	if n := len(o.Msg.Payload); n > b.cfg.MaxMessageBytes {
		return fmt.Errorf("rabbitmq: message %s to %q has a %d-byte body, over the limit of %d bytes (broker.rabbitmq.max_message_bytes): %w",
			o.Msg.UUID, o.Topic, n, b.cfg.MaxMessageBytes, adapters.ErrMessageTooLarge)
	}
	if err := b.rules.CheckMessage(o.Topic, o.Msg); err != nil {
		return err
	}
	b.mu.Lock()
	serverMax := b.serverMax
	b.mu.Unlock()
	if n := len(o.Msg.Payload); serverMax > 0 && n > serverMax {
		return tooLargeForServer(o, n, serverMax)
	}
	var err error
	*p, err = Marshaler{}.Marshal(o.Msg)
	return err
}

func tooLargeForServer(o adapters.Outgoing, size, serverMax int) error {
	return fmt.Errorf("rabbitmq: message %s to %q has a %d-byte body, over the server's max_message_size of %d bytes "+
		"(set broker.rabbitmq.max_message_bytes to at most that): %w", o.Msg.UUID, o.Topic, size, serverMax, adapters.ErrMessageTooLarge)
}

// serverMaxPattern finds the limit in the broker's refusal of a too large
// message: "PRECONDITION_FAILED - message size 2000000 is larger than
// configured max size 1048576".
var serverMaxPattern = regexp.MustCompile(`larger than configured max size (\d+)`)

// headerFrameBytes is the size of p's AMQP content header frame payload:
// class, weight, body size, property flags, delivery mode, message id and
// the headers table (every value a string). It must fit one frame.
func headerFrameBytes(p amqp.Publishing) int {
	n := 2 + 2 + 8 + 2 + 1 + 1 + len(p.MessageId) + 4
	for k, v := range p.Headers {
		s, _ := v.(string)
		n += 1 + len(k) + 1 + 4 + len(s)
	}
	return n
}

// checkHeaderFrames refuses, permanently, every message whose headers do
// not fit one frame of conn: sent anyway, the broker would close the whole
// connection (FRAME_ERROR) and fail every message in flight with it, on
// every retry.
func checkHeaderFrames(conn *amqp.Connection, msgs []adapters.Outgoing, pubs []amqp.Publishing, errs []error) {
	limit := conn.Config.FrameSize - frameOverhead
	if limit <= 0 {
		return
	}
	for i := range msgs {
		if errs[i] != nil {
			continue
		}
		if n := headerFrameBytes(pubs[i]); n > limit {
			errs[i] = fmt.Errorf("rabbitmq: message %s to %q has %d bytes of metadata headers; they must fit one AMQP frame (%d bytes, the negotiated frame_max): %w",
				msgs[i].Msg.UUID, msgs[i].Topic, n, conn.Config.FrameSize, adapters.ErrMessageTooLarge)
		}
	}
}

// failUnsent sets err for every message without an error yet.
func failUnsent(errs []error, err error) {
	for i := range errs {
		if errs[i] == nil {
			errs[i] = err
		}
	}
}

// sentMsg is a published message waiting for its confirm.
type sentMsg struct {
	idx int
	dc  *amqp.DeferredConfirmation
}

// publishOn publishes every message of msgs whose errs entry is still nil
// and records the outcome there. It reports whether cc is still healthy.
func (b *Broker) publishOn(ctx context.Context, cc *confirmChannel, msgs []adapters.Outgoing, pubs []amqp.Publishing, errs []error) bool {
	r := &confirmRun{b: b, ctx: ctx, cc: cc, msgs: msgs, errs: errs, returned: map[string]string{}, healthy: true}
	aborted, stoppedAt := r.publishAll(pubs)
	for len(r.inflight) > 0 && !aborted {
		aborted = !r.waitOldest()
	}
	// Every basic.return precedes the confirm of its message, so once a
	// message is settled its return, if any, is in the buffer.
	r.drainReturns()
	if aborted {
		r.failAborted(stoppedAt)
	}
	b.refuseOverServerMax(cc, msgs, errs)
	if len(r.returned) > 0 {
		r.failReturned()
	}
	return r.healthy
}

// confirmRun is one publishOn: the messages it sent, their confirms and
// the broker's returns.
type confirmRun struct {
	b         *Broker
	ctx       context.Context
	cc        *confirmChannel
	msgs      []adapters.Outgoing
	errs      []error
	returned  map[string]string // exchange + message id -> reply text
	inflight  []sentMsg
	published []int
	healthy   bool
}

// publishAll sends the messages without an error yet, keeping at most
// publishWindow unconfirmed. It reports whether ctx ended (aborted) and,
// then, the first message not sent.
func (r *confirmRun) publishAll(pubs []amqp.Publishing) (aborted bool, stoppedAt int) {
	stoppedAt = len(r.msgs) // messages from here on were not published
	for i := range r.msgs {
		if r.errs[i] != nil {
			continue
		}
		for len(r.inflight) >= publishWindow && !aborted {
			aborted = !r.waitOldest()
		}
		r.drainReturns()
		if aborted || r.ctx.Err() != nil {
			return true, i
		}
		dc, err := r.cc.ch.PublishWithDeferredConfirmWithContext(r.ctx, r.msgs[i].Topic, "", true, false, pubs[i])
		if err != nil {
			if reason := r.cc.closeReason(); reason != nil || errors.Is(err, amqp.ErrClosed) {
				r.healthy = false
				failUnsent(r.errs[i:], fmt.Errorf("rabbitmq: not published: the channel to %s closed: %w", r.b.redacted, err))
				break
			}
			r.errs[i] = fmt.Errorf("rabbitmq: publish message %s to %q: %w", r.msgs[i].Msg.UUID, r.msgs[i].Topic, err)
			continue
		}
		r.inflight = append(r.inflight, sentMsg{idx: i, dc: dc})
		r.published = append(r.published, i)
	}
	return aborted, stoppedAt
}

// drainReturns takes in the broker's returns buffered so far.
func (r *confirmRun) drainReturns() {
	for {
		select {
		case ret, ok := <-r.cc.returns:
			if !ok {
				return
			}
			r.returned[ret.Exchange+"\x00"+ret.MessageId] = ret.ReplyText
		default:
			return
		}
	}
}

// waitOldest settles the oldest message in flight; false when ctx ended first.
func (r *confirmRun) waitOldest() bool {
	select {
	case <-r.inflight[0].dc.Done():
		r.settle(r.inflight[0])
		r.inflight = r.inflight[1:]
		return true
	case <-r.ctx.Done():
		return false
	}
}

// settle records the broker's confirm of s.
func (r *confirmRun) settle(s sentMsg) {
	switch reason := r.cc.closeReason(); {
	case s.dc.Acked():
	case reason != nil:
		r.healthy = false
		r.errs[s.idx] = fmt.Errorf("rabbitmq: channel to %s closed before the broker confirmed the message: %w", r.b.redacted, reason)
	default:
		// A channel's queue clients can keep a quorum queue's old leader
		// after a failover and nack every later publish: a nacked
		// channel is not used again.
		r.healthy = false
		r.errs[s.idx] = fmt.Errorf("rabbitmq: message %s to %q: %w", r.msgs[s.idx].Msg.UUID, r.msgs[s.idx].Topic, ErrNacked)
	}
}

// failAborted fails, after ctx ended, the messages still in flight and
// those from stoppedAt on that were not sent.
func (r *confirmRun) failAborted(stoppedAt int) {
	r.healthy = false
	notConfirmed := fmt.Errorf("rabbitmq: not confirmed before the context ended: %w", r.ctx.Err())
	for _, s := range r.inflight {
		r.errs[s.idx] = notConfirmed
	}
	failUnsent(r.errs[stoppedAt:], fmt.Errorf("rabbitmq: not published: %w", r.ctx.Err()))
}

// failReturned fails the published messages the broker returned unrouted.
func (r *confirmRun) failReturned() {
	r.b.forgetTopics(r.cc.conn)
	for _, i := range r.published {
		if text, ok := r.returned[r.msgs[i].Topic+"\x00"+r.msgs[i].Msg.UUID]; ok {
			r.errs[i] = fmt.Errorf("rabbitmq: message %s to %q came back %s: no queue was bound, not even the parking queue %q of its alternate exchange: %w",
				r.msgs[i].Msg.UUID, r.msgs[i].Topic, text, UnroutedQueueName(r.msgs[i].Topic), ErrUnroutable)
		}
	}
}

// refuseOverServerMax handles a body over the server's max_message_size,
// which made the broker close cc: the messages too large for it are
// permanent failures (and later ones are refused before sending), the
// others retryable.
func (b *Broker) refuseOverServerMax(cc *confirmChannel, msgs []adapters.Outgoing, errs []error) {
	var ae *amqp.Error
	if !errors.As(cc.closeReason(), &ae) || ae.Code != amqp.PreconditionFailed {
		return
	}
	m := serverMaxPattern.FindStringSubmatch(ae.Reason)
	if m == nil {
		return
	}
	serverMax, _ := strconv.Atoi(m[1])
	b.mu.Lock()
	b.serverMax = serverMax
	b.mu.Unlock()
	for i, o := range msgs {
		if errs[i] != nil && !adapters.IsPermanent(errs[i]) && len(o.Msg.Payload) > serverMax {
			errs[i] = tooLargeForServer(o, len(o.Msg.Payload), serverMax)
		}
	}
}
