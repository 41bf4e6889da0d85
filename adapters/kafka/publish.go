package kafka

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/names"
)

// recordVersion is the record format Sarama sizes messages with (v2, Kafka 0.11+).
const recordVersion = 2

// ticket rides in a record's Metadata so routeResults can hand the broker's
// answer back to the PublishBatch call, and the index, that sent it.
type ticket struct {
	results chan<- result
	index   int
}

type result struct {
	index     int
	partition int32
	err       error
}

// routeResults hands every producer answer to the call that sent the record,
// until the producer is closed.
func (b *Broker) routeResults() {
	defer b.routed.Done()
	successes, failures := b.producer.Successes(), b.producer.Errors()
	for successes != nil || failures != nil {
		select {
		case m, ok := <-successes:
			if !ok {
				successes = nil
				continue
			}
			deliver(m, nil)
		case e, ok := <-failures:
			if !ok {
				failures = nil
				continue
			}
			deliver(e.Msg, e.Err)
		}
	}
}

func deliver(m *sarama.ProducerMessage, err error) {
	if t, ok := m.Metadata.(ticket); ok {
		t.results <- result{index: t.index, partition: m.Partition, err: err} // buffered for the whole batch: never blocks
	}
}

// PublishBatch sends msgs pipelined through the idempotent producer and
// waits for every acknowledgement (acks=all). It returns nil when all were
// acknowledged, else a *adapters.BatchError with one error per message.
//
// A message over the size limit fails alone with a permanent error naming
// the limit. The broker refuses a whole record batch (all messages of one
// partition sent together) when one message in it is over the topic's
// max.message.bytes; the messages of such a batch are then sent again one by
// one, so only the large one fails.
//
// A partition's order holds within a call: once a message failed retryably
// (the producer spent producer_retries on it), no later message of its
// topic and partition counts as confirmed, even if the broker took it, so
// the caller sends them all again after the failed one. The broker may
// then hold such a later message twice, once before the failed one.
func (b *Broker) PublishBatch(ctx context.Context, msgs []adapters.Outgoing) error {
	if len(msgs) == 0 {
		return nil
	}
	errs, partitions := b.send(ctx, msgs)
	for i, err := range errs {
		if !errors.Is(err, sarama.ErrMessageSizeTooLarge) {
			continue
		}
		// One record per batch now; order among these retries is kept
		// because each waits for the previous one's answer.
		single, _ := b.send(ctx, msgs[i:i+1])
		err = single[0]
		if errors.Is(err, sarama.ErrMessageSizeTooLarge) {
			err = b.overBrokerLimit(msgs[i])
		}
		errs[i] = err
	}
	for i, err := range errs {
		if errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
			// The topic was deleted or the cluster replaced since it was
			// provisioned: make sure it exists again on the next call.
			b.provisioned.Delete(msgs[i].Topic)
		}
		errs[i] = classify(msgs[i].Topic, err)
	}
	keepPartitionOrder(msgs, errs, partitions)
	return adapters.NewBatchError(errs)
}

// keepPartitionOrder fails every message confirmed after a retryable
// failure of an earlier message of the same topic and partition.
func keepPartitionOrder(msgs []adapters.Outgoing, errs []error, partitions []int32) {
	type topicPartition struct {
		topic     string
		partition int32
	}
	failed := map[topicPartition]int{}
	for i, err := range errs {
		tp := topicPartition{msgs[i].Topic, partitions[i]}
		first, seen := failed[tp]
		switch {
		case err != nil && !adapters.IsPermanent(err) && !seen:
			failed[tp] = i
		case err == nil && seen:
			errs[i] = fmt.Errorf("kafka: not confirmed in order: message %s of the same partition (%s/%d) failed before it: %w",
				msgs[first].Msg.UUID, tp.topic, tp.partition, errs[first])
		}
	}
}

// send hands msgs to the producer and waits for their answers or ctx. The
// errors are as the producer reported them; PublishBatch classifies them.
// partitions holds the partition each answered message went to.
func (b *Broker) send(ctx context.Context, msgs []adapters.Outgoing) (errs []error, partitions []int32) {
	errs = make([]error, len(msgs))
	partitions = make([]int32, len(msgs))
	fill := func(from int, err error) {
		for i := from; i < len(msgs); i++ {
			if errs[i] == nil {
				errs[i] = err
			}
		}
	}
	if b.closed.Load() {
		fill(0, ErrClosed)
		return errs, partitions
	}
	topicErrs := map[string]error{}
	for i, o := range msgs {
		if o.Msg == nil {
			errs[i] = adapters.Permanent(errors.New("kafka: nil message"))
			continue
		}
		err, seen := topicErrs[o.Topic]
		if !seen {
			err = b.ensureTopic(ctx, o.Topic)
			topicErrs[o.Topic] = err
		}
		errs[i] = err
	}

	results := make(chan result, len(msgs))
	sent := make([]bool, len(msgs))
	pending := 0
	b.sendMu.RLock()
	for i, o := range msgs {
		if errs[i] != nil {
			continue
		}
		pm, err := b.record(o)
		if err != nil {
			errs[i] = err
			continue
		}
		pm.Metadata = ticket{results: results, index: i}
		var stop error
		if b.closed.Load() {
			stop = ErrClosed
		} else {
			select {
			case b.producer.Input() <- pm:
				sent[i] = true
				pending++
			case <-ctx.Done():
				stop = fmt.Errorf("kafka: not sent: %w", ctx.Err())
			case <-b.closing:
				stop = ErrClosed
			}
		}
		if stop != nil {
			fill(i, stop)
			break
		}
	}
	b.sendMu.RUnlock()

	for pending > 0 {
		select {
		case r := <-results:
			errs[r.index], partitions[r.index] = r.err, r.partition
			sent[r.index] = false
			pending--
		case <-ctx.Done():
			for i, waiting := range sent {
				if waiting {
					errs[i] = fmt.Errorf("kafka: not acknowledged before the context ended (it may still arrive): %w", ctx.Err())
				}
			}
			return errs, partitions
		}
	}
	return errs, partitions
}

// record turns o into a Kafka record, refusing what the broker would refuse.
func (b *Broker) record(o adapters.Outgoing) (*sarama.ProducerMessage, error) {
	if err := names.Topic(o.Topic); err != nil {
		return nil, adapters.Permanent(fmt.Errorf("kafka: topic %q: %w", o.Topic, err))
	}
	pm, err := Marshaler{}.Marshal(o.Topic, o.Msg)
	if err != nil {
		return nil, adapters.Permanent(fmt.Errorf("kafka: message %s: %w", o.Msg.UUID, err))
	}
	if size := pm.ByteSize(recordVersion); size > b.cfg.MaxMessageBytes {
		return nil, adapters.Permanent(fmt.Errorf(
			"kafka: message %s is %d bytes with key and headers, over the limit of %d bytes (broker.kafka.max_message_bytes): %w",
			o.Msg.UUID, size, b.cfg.MaxMessageBytes, adapters.ErrMessageTooLarge))
	}
	return pm, nil
}

// overBrokerLimit is the error for a message the broker refused on its own
// as too large: the topic's or broker's limit is below max_message_bytes.
func (b *Broker) overBrokerLimit(o adapters.Outgoing) error {
	size := 0
	if pm, err := (Marshaler{}).Marshal(o.Topic, o.Msg); err == nil {
		size = pm.ByteSize(recordVersion)
	}
	limit := "its max.message.bytes (the topic's config could not be read)"
	if n, err := b.topicMaxMessageBytes(o.Topic); err == nil {
		limit = fmt.Sprintf("its max.message.bytes of %d bytes", n)
	}
	return adapters.Permanent(fmt.Errorf(
		"kafka: message %s (%d bytes with key and headers) refused by the broker: topic %s accepts record batches up to %s, less than broker.kafka.max_message_bytes %d: %w",
		o.Msg.UUID, size, o.Topic, limit, b.cfg.MaxMessageBytes, adapters.ErrMessageTooLarge))
}

// classify wraps a producer error with its topic and marks the errors that
// resending the same message cannot fix as permanent. Everything else
// (broker gone, leader moving, timeouts, authorization) is retryable.
func classify(topic string, err error) error {
	if err == nil || adapters.IsPermanent(err) || errors.Is(err, ErrClosed) {
		return err
	}
	var confErr sarama.ConfigurationError
	switch {
	case errors.As(err, &confErr) && strings.Contains(string(confErr), "MaxMessageBytes"):
		return adapters.Permanent(fmt.Errorf("kafka: topic %s: %w: %w", topic, err, adapters.ErrMessageTooLarge))
	case errors.Is(err, sarama.ErrInvalidRecord),
		errors.Is(err, sarama.ErrInvalidTopic),
		errors.Is(err, sarama.ErrInvalidTimestamp),
		errors.Is(err, sarama.ErrMessageSetSizeTooLarge):
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
