package kafka

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/names"
)

// PublishBatch sends msgs pipelined through the idempotent producer and
// waits for every acknowledgement (acks=all). It returns nil when all were
// acknowledged, else a *adapters.BatchError with one error per message.
//
// A message over broker.kafka.max_message_bytes fails alone with a
// permanent error naming the limit. The broker refuses a whole record batch
// (the messages of one partition sent together) when one message in it is
// over the topic's max.message.bytes; the messages of such a batch are then
// sent again one by one, so only the large one fails.
//
// Order: the messages of one topic and key (aggregate id) reach the
// partition log in the order of msgs. When one fails retryably, every later
// message of its partition fails too and none of them is in the log, so a
// caller that sends again from the first failed message (as the relay does)
// keeps the key's order; see send for how. A broker outage is ridden out
// for broker.kafka.producer_retries x producer_retry_backoff before the
// messages fail, retryably.
func (b *Broker) PublishBatch(ctx context.Context, msgs []adapters.Outgoing) error {
	if len(msgs) == 0 {
		return nil
	}
	if b.closed.Load() {
		return adapters.FailAll(len(msgs), errClosed)
	}
	errs := make([]error, len(msgs))
	records := make([]*kgo.Record, len(msgs))
	topicErrs := map[string]error{}
	for i, o := range msgs {
		if records[i], errs[i] = b.record(o); errs[i] != nil {
			continue
		}
		err, seen := topicErrs[o.Topic]
		if !seen {
			err = b.ensureTopic(ctx, o.Topic)
			topicErrs[o.Topic] = err
		}
		errs[i] = err
	}
	b.send(ctx, records, errs)
	b.resendTooLarge(ctx, msgs, errs)
	for i, err := range errs {
		if errors.Is(err, kerr.UnknownTopicOrPartition) || errors.Is(err, kerr.UnknownTopicID) {
			// The topic was deleted or the cluster replaced since it was
			// provisioned: make sure it exists again on the next call, and
			// have the client forget the old one (a recreated topic has a
			// new id, which the client refuses until it forgets the old).
			b.provisioned.Delete(msgs[i].Topic)
			b.purge.Store(msgs[i].Topic, struct{}{})
		}
		errs[i] = classify(msgs[i].Topic, err)
	}
	return adapters.NewBatchError(errs)
}

// resendTooLarge sends each message the broker refused as part of a too
// large record batch again alone, in order, so that only the message that
// is too large on its own fails. After a message that fails retryably
// alone, the rest are not sent: they would be in the log before it.
func (b *Broker) resendTooLarge(ctx context.Context, msgs []adapters.Outgoing, errs []error) {
	var stopped error
	for i, err := range errs {
		if !errors.Is(err, kerr.MessageTooLarge) {
			continue
		}
		if stopped != nil {
			errs[i] = stopped
			continue
		}
		record, err := b.record(msgs[i])
		single := []error{err}
		b.send(ctx, []*kgo.Record{record}, single)
		switch err := single[0]; {
		case errors.Is(err, kerr.MessageTooLarge):
			errs[i] = b.overBrokerLimit(ctx, msgs[i], record)
		case err == nil || adapters.IsPermanent(classify(msgs[i].Topic, err)):
			errs[i] = err
		default:
			errs[i] = err
			stopped = fmt.Errorf("kafka: not sent: message %s before it failed (%v)", msgs[i].Msg.UUID, err)
		}
	}
}

// send hands the records whose errs entry is nil to the client, waits for
// the client's answers, and puts them in errs. It gives up waiting when ctx
// ends, at Close, or after broker.kafka.producer_retries x
// producer_retry_backoff + producer_timeout (the client keeps retrying a
// request whose outcome it cannot know); the records not answered by then
// fail retryably, though they may still arrive.
//
// Why each key keeps its order. The relay acks the prefix of its rows the
// broker confirmed and sends the rest again, so order holds as long as no
// record of a key is written while an earlier record of it, of this call
// or an earlier one, has failed and not been sent again. Three rules keep
// that:
//
//  1. One send at a time (b.publishing), from before its first record goes
//     to the client until the client has answered every record of it, even
//     when send has returned early: the records of an earlier call are all
//     resolved before those of a later call go in.
//  2. Nothing is sent until every record of the call is in the client
//     (kgo.ManualFlushing: send flushes after the last Produce). Once they
//     all are, kgo keeps each partition gapless: a failure (retries or
//     delivery timeout spent, a refusal by the broker, Close) fails every
//     record buffered in the partition, and the idempotent producer writes a
//     partition's batches strictly in sequence (the broker refuses a batch
//     whose predecessor it lacks; kgo resends from the first unacknowledged
//     batch and renumbers under a new producer epoch what it failed). So
//     what a partition writes of the call is a prefix, and every record
//     after a failed one fails with it. A request that was written but not
//     answered is retried, never failed (only Close fails such records,
//     written or not, with every later record of their partitions: sent
//     again, they are duplicates, never out of order).
//  3. A record can still fail while the call is going into the client (a
//     metadata failure of its topic, Close); the later records of its
//     partition would then start a new buffer and be sent. The fence finds
//     that: kgo calls the promises in order on one goroutine, and queues a
//     record's failure while it holds the lock that a later record of the
//     partition needs to be buffered, so the promise of the fence record
//     (which fails at once: it has no topic), produced after the last
//     record, runs after every failure that came before. If there was one,
//     nothing has been sent yet, and send fails every record of the call
//     without sending any.
func (b *Broker) send(ctx context.Context, records []*kgo.Record, errs []error) {
	idx := sendable(records, errs)
	if len(idx) == 0 {
		return
	}
	limit := b.cfg.deliveryTimeout() + b.cfg.ProducerTimeout
	if err := b.acquirePublishing(ctx, limit); err != nil {
		for _, i := range idx {
			errs[i] = err
		}
		return
	}
	b.purgeTopics()
	answers := b.produceFenced(records, idx)
	if first := answers.firstFailure(); first >= 0 {
		// Nothing was sent, and nothing else is in the client (rule 1),
		// so failing everything buffered fails only this call's records,
		// none of which the broker can have.
		b.client.UnsafeAbortBufferedRecords()
		<-answers.done
		b.releasePublishing()
		failNotSent(records, idx, errs, answers, first)
		return
	}
	go func() {
		_ = b.client.Flush(b.flushCtx) // returns once every record is answered, or at Close
		b.releasePublishing()
	}()
	awaitAnswers(ctx, b.closing, limit, answers, idx, errs)
}

// sendable returns the indexes of the records to send: those without an
// error yet.
func sendable(records []*kgo.Record, errs []error) []int {
	var idx []int
	for i, r := range records {
		if r != nil && errs[i] == nil {
			idx = append(idx, i)
		}
	}
	return idx
}

// acquirePublishing waits for the turn to send (rule 1 of send), at most
// limit, and returns why the records are not sent when it does not get it.
// Once it has, releasePublishing ends the turn.
func (b *Broker) acquirePublishing(ctx context.Context, limit time.Duration) error {
	wait := time.NewTimer(limit)
	defer wait.Stop()
	select {
	case b.publishing <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("kafka: not sent: %w", ctx.Err())
	case <-b.closing:
		return errClosed
	case <-wait.C:
		return fmt.Errorf("kafka: not sent: the previous publish was still unanswered after %s (broker.kafka.producer_retries x producer_retry_backoff + producer_timeout)", limit)
	}
	b.closeMu.RLock()
	if b.closed.Load() {
		b.closeMu.RUnlock()
		<-b.publishing
		return errClosed
	}
	b.sending.Add(1) // done once the client has answered every record (or at Close)
	b.closeMu.RUnlock()
	return nil
}

// releasePublishing ends the turn acquirePublishing gave.
func (b *Broker) releasePublishing() {
	<-b.publishing
	b.sending.Done()
}

// purgeTopics drops from the client's producer the topics marked to purge.
func (b *Broker) purgeTopics() {
	b.purge.Range(func(topic, _ any) bool {
		b.client.PurgeTopicsFromProducing(topic.(string))
		b.purge.Delete(topic)
		return true
	})
}

// produceFenced puts the records of idx in the client, then the fence
// (rule 3 of send), and returns once the fence's promise ran.
func (b *Broker) produceFenced(records []*kgo.Record, idx []int) *answers {
	answers := newAnswers(len(idx))
	for k, i := range idx {
		b.client.Produce(context.Background(), records[i], answers.promise(k))
	}
	fenced := make(chan struct{})
	b.client.Produce(context.Background(), &kgo.Record{}, func(*kgo.Record, error) { close(fenced) })
	<-fenced
	return answers
}

// failNotSent puts in errs the answers to a call that failed before it was
// sent, the record at first failing first: the records aborted because of
// it fail as it did (closed, or retryably), but never permanently: nothing
// is wrong with them.
func failNotSent(records []*kgo.Record, idx []int, errs []error, answers *answers, first int) {
	cause := answers.errs[first]
	notSent := fmt.Errorf("kafka: not sent: another message of the batch failed before it was sent: %w", cause)
	if adapters.IsPermanent(classify(records[idx[first]].Topic, cause)) {
		notSent = fmt.Errorf("kafka: not sent: another message of the batch failed before it was sent (%v)", cause)
	}
	for k, i := range idx {
		errs[i] = answers.errs[k]
		if errors.Is(errs[i], kgo.ErrAborting) {
			errs[i] = notSent
		}
	}
}

// awaitAnswers waits, at most limit, until ctx ends or closing is closed,
// for the client's answers to the records of idx and puts them in errs;
// those not answered fail retryably.
func awaitAnswers(ctx context.Context, closing <-chan struct{}, limit time.Duration, answers *answers, idx []int, errs []error) {
	answered := time.NewTimer(limit)
	defer answered.Stop()
	var unanswered error
	select {
	case <-answers.done:
	case <-ctx.Done():
		unanswered = fmt.Errorf("kafka: not acknowledged before the context ended (it may still arrive): %w", ctx.Err())
	case <-closing:
		unanswered = errClosed
	case <-answered.C:
		unanswered = fmt.Errorf("kafka: not acknowledged within %s (broker.kafka.producer_retries x producer_retry_backoff + producer_timeout; it may still arrive)", limit)
	}
	answers.mu.Lock()
	defer answers.mu.Unlock()
	for k, i := range idx {
		if answers.answered[k] {
			errs[i] = answers.errs[k]
		} else {
			errs[i] = unanswered
		}
	}
}

// answers collects the client's answers to the records of one send.
type answers struct {
	mu       sync.Mutex
	errs     []error
	answered []bool
	failed   int // index of the first record answered with an error, -1 if none
	left     int
	done     chan struct{} // closed once every record is answered
}

func newAnswers(n int) *answers {
	return &answers{errs: make([]error, n), answered: make([]bool, n), failed: -1, left: n, done: make(chan struct{})}
}

// promise returns the kgo promise of record k. kgo calls promises one at a
// time; they must not block.
func (a *answers) promise(k int) func(*kgo.Record, error) {
	return func(_ *kgo.Record, err error) {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.errs[k], a.answered[k] = err, true
		if err != nil && a.failed < 0 {
			a.failed = k
		}
		if a.left--; a.left == 0 {
			close(a.done)
		}
	}
}

func (a *answers) firstFailure() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.failed
}

// Sizes of a record batch as the producer counts them against
// ProducerBatchMaxBytes (broker.kafka.max_message_bytes).
const (
	// batchHeaderBytes is a record batch's header with its length prefix.
	batchHeaderBytes = 65
	varintBytes      = binary.MaxVarintLen32
	varlongBytes     = binary.MaxVarintLen64
)

// batchBytes is the size of a record batch that holds only r, with every
// variable-length number at its widest: a record of at most
// max_message_bytes by this count always fits a batch of its own.
func batchBytes(r *kgo.Record) int {
	n := batchHeaderBytes + varintBytes + // the batch's flexible length prefix
		varintBytes + 1 + varlongBytes + varintBytes + // record length, attributes, timestamp and offset deltas
		varintBytes + len(r.Key) + varintBytes + len(r.Value) + varintBytes
	for _, h := range r.Headers {
		n += varintBytes + len(h.Key) + varintBytes + len(h.Value)
	}
	return n
}

// record turns o into a Kafka record in watermill-kafka's format (see
// Marshaler), refusing what the broker would refuse (Rules).
func (b *Broker) record(o adapters.Outgoing) (*kgo.Record, error) {
	if o.Msg == nil {
		return nil, adapters.Permanent(errors.New("kafka: nil message"))
	}
	if err := names.Topic(o.Topic); err != nil {
		return nil, adapters.Permanent(fmt.Errorf("kafka: topic %q: %w", o.Topic, err))
	}
	r, err := toRecord(o.Topic, o.Msg)
	if err != nil {
		return nil, err
	}
	if err := b.rules.checkRecord(o.Msg, r); err != nil {
		return nil, err
	}
	return r, nil
}

// toRecord is msg as a record on topic, in watermill-kafka's format.
func toRecord(topic string, msg *message.Message) (*kgo.Record, error) {
	pm, err := Marshaler{}.Marshal(topic, msg)
	if err != nil {
		return nil, adapters.Permanent(fmt.Errorf("kafka: message %s: %w", msg.UUID, err))
	}
	r := &kgo.Record{Topic: topic, Headers: make([]kgo.RecordHeader, len(pm.Headers))}
	if pm.Key != nil {
		if r.Key, err = pm.Key.Encode(); err != nil {
			return nil, adapters.Permanent(fmt.Errorf("kafka: message %s: key: %w", msg.UUID, err))
		}
	}
	if r.Value, err = pm.Value.Encode(); err != nil {
		return nil, adapters.Permanent(fmt.Errorf("kafka: message %s: value: %w", msg.UUID, err))
	}
	for i, h := range pm.Headers {
		r.Headers[i] = kgo.RecordHeader{Key: string(h.Key), Value: h.Value}
	}
	return r, nil
}

// overBrokerLimit is the error for a message the broker refused on its own
// as too large: the topic's or broker's limit is below max_message_bytes.
func (b *Broker) overBrokerLimit(ctx context.Context, o adapters.Outgoing, r *kgo.Record) error {
	limit := "its max.message.bytes (the topic's config could not be read)"
	if n, err := b.topicMaxMessageBytes(ctx, o.Topic); err == nil {
		limit = fmt.Sprintf("its max.message.bytes of %d bytes", n)
	}
	return adapters.Permanent(fmt.Errorf(
		"kafka: message %s (%d bytes as a record batch with key and headers) refused by the broker: topic %s accepts record batches up to %s, less than broker.kafka.max_message_bytes %d: %w",
		o.Msg.UUID, batchBytes(r), o.Topic, limit, b.cfg.MaxMessageBytes, adapters.ErrMessageTooLarge))
}

// classify wraps a producer error with its topic and marks the errors that
// resending the same message cannot fix as permanent. Everything else
// (broker gone, leader moving, timeouts, authorization) is retryable.
func classify(topic string, err error) error {
	switch {
	case err == nil || adapters.IsPermanent(err) || errors.Is(err, errClosed):
		return err
	case errors.Is(err, kgo.ErrClientClosed):
		return fmt.Errorf("%w: %w", errClosed, err)
	case errors.Is(err, kerr.MessageTooLarge), errors.Is(err, kerr.RecordListTooLarge):
		return adapters.Permanent(fmt.Errorf("kafka: topic %s refused the message as too large: %w: %w", topic, err, adapters.ErrMessageTooLarge))
	case errors.Is(err, kerr.InvalidRecord),
		errors.Is(err, kerr.InvalidTopicException),
		errors.Is(err, kerr.InvalidTimestamp):
		return adapters.Permanent(fmt.Errorf("kafka: topic %s refused the message: %w", topic, err))
	}
	return fmt.Errorf("kafka: publish to topic %s: %w", topic, err)
}

// Publisher returns a Watermill publisher over the Broker's producer. Publish
// sends its messages pipelined and returns once the broker acknowledged all
// of them (or one failed: the error is a *adapters.BatchError). Closing it
// stops only this publisher; the producer closes with the Broker.
//
// It is not watermill-kafka's Publisher, which owns a second producer and
// waits for each message before sending the next.
func (b *Broker) Publisher() message.Publisher { return &publisher{b: b} }

type publisher struct {
	b      *Broker
	closed atomic.Bool
}

// Publish publishes msgs to topic and waits for the broker's acknowledgements.
func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	if p.closed.Load() {
		return errors.New("kafka: publisher closed")
	}
	out := make([]adapters.Outgoing, len(msgs))
	for i, m := range msgs {
		out[i] = adapters.Outgoing{Topic: topic, Msg: m}
	}
	return p.b.PublishBatch(context.Background(), out)
}

// Close stops this publisher. It is idempotent.
func (p *publisher) Close() error {
	p.closed.Store(true)
	return nil
}
