package middleware

import (
	"cmp"
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
)

// Metadata keys of the failure envelope a poisoned message carries on the
// poison topic. In the poison table the same fields are columns.
const (
	PoisonReasonKey        = "poison-reason"         // the error, truncated to MaxPoisonReasonBytes
	PoisonErrorClassKey    = "poison-error-class"    // ClassPermanent or ClassTransient
	PoisonAttemptsKey      = "poison-attempts"       // attempts made in the last delivery (in all deliveries when the broker schedules redeliveries), decimal
	PoisonFirstFailureKey  = "poison-first-failure"  // RFC 3339 with nanoseconds, UTC
	PoisonLastFailureKey   = "poison-last-failure"   // RFC 3339 with nanoseconds, UTC
	PoisonSourceTopicKey   = "poison-source-topic"   // the topic the handler consumes
	PoisonHandlerKey       = "poison-handler"        // the handler's name
	PoisonConsumerGroupKey = "poison-consumer-group" // the handler's consumer group
	PoisonTraceparentKey   = "poison-traceparent"    // the message's W3C traceparent, if any
	PoisonedAtKey          = "poisoned-at"           // when it was poisoned, RFC 3339, UTC
)

// ReplayOfKey marks a message replayed from the poison table (`millrace dlq
// replay`); its value is the message id of the poisoned original. A replay has
// a message id of its own, because brokers that deduplicate by message id
// (JetStream's Nats-Msg-Id) would drop a second message with the original's,
// and keeps the event id, so that the inbox still deduplicates it. A replay
// that is poisoned again updates the original's row instead of adding one.
const ReplayOfKey = "replay-of"

// ReplayGroupsKey names the consumer groups a replay from the poison table
// is for, separated by commas: the groups whose poisoned rows of the event
// the replay re-sends. The broker hands the replay to every group of its
// topic; the chain of any other group acks it without calling the handler
// and without writing an inbox row, and counts it as OutcomeNotTargeted, so
// that a replay takes effect only where the event failed (a group created
// after the event, or whose inbox no longer holds it, would otherwise
// process it again). A message without the key is for every group.
const ReplayGroupsKey = "replay-groups"

// ReplayGroupsSeparator separates the groups in ReplayGroupsKey's value;
// consumer group names cannot contain it.
const ReplayGroupsSeparator = ","

// MaxPoisonReasonBytes bounds the reason in the poison topic's metadata
// (brokers limit header sizes); the poison table keeps the whole text.
const MaxPoisonReasonBytes = 2048

// failure is the failure envelope of one poisoned message.
type failure struct {
	reason        string
	class         string
	attempts      int
	firstFailure  time.Time
	lastFailure   time.Time
	sourceTopic   string
	handler       string
	consumerGroup string
	traceparent   string
	poisonedAt    time.Time
}

func (c *Chain) failureOf(msg *message.Message, d *delivery) failure {
	now := c.stack.now()
	f := failure{
		reason:        "unknown failure",
		class:         ClassTransient,
		attempts:      max(d.attempts, 1),
		firstFailure:  d.firstFailure,
		lastFailure:   d.lastFailure,
		sourceTopic:   c.spec.Topic,
		handler:       c.spec.Name,
		consumerGroup: c.spec.ConsumerGroup,
		traceparent:   msg.Metadata.Get(envelope.TraceparentKey),
		poisonedAt:    now,
	}
	if d.finalErr != nil {
		f.reason = d.finalErr.Error()
		f.class = classOf(d.finalErr)
	}
	if f.firstFailure.IsZero() {
		f.firstFailure = now
	}
	if f.lastFailure.IsZero() {
		f.lastFailure = f.firstFailure
	}
	return f
}

// metadata returns the failure envelope as metadata keys.
func (f failure) metadata() map[string]string {
	reason := f.reason
	if len(reason) > MaxPoisonReasonBytes {
		reason = strings.ToValidUTF8(reason[:MaxPoisonReasonBytes], "") + "…"
	}
	return map[string]string{
		PoisonReasonKey:        reason,
		PoisonErrorClassKey:    f.class,
		PoisonAttemptsKey:      strconv.Itoa(f.attempts),
		PoisonFirstFailureKey:  f.firstFailure.UTC().Format(time.RFC3339Nano),
		PoisonLastFailureKey:   f.lastFailure.UTC().Format(time.RFC3339Nano),
		PoisonSourceTopicKey:   f.sourceTopic,
		PoisonHandlerKey:       f.handler,
		PoisonConsumerGroupKey: f.consumerGroup,
		PoisonTraceparentKey:   f.traceparent,
		PoisonedAtKey:          f.poisonedAt.UTC().Format(time.RFC3339Nano),
	}
}

// poisonQueue is the poison stage: Watermill's PoisonQueueWithFilter does
// the catching (shouldPoison), and a poisonPublisher of the message's own,
// which knows its delivery state, stores what it catches.
func (c *Chain) poisonQueue(next step) step {
	return func(m *inflight) error {
		mw, err := wmw.PoisonQueueWithFilter(&poisonPublisher{chain: c, d: m.d}, c.poisonTopic, shouldPoison)
		if err != nil {
			return err // an empty topic, which Chain never gives it
		}
		return watermillStage(mw)(next)(m)
	}
}

// poisonPublisher is the publisher Watermill's PoisonQueueWithFilter hands
// a poisoned message to. It adds the failure envelope from the message's
// delivery state d and stores the message in the poison table or publishes
// it to the poison topic. A store that fails is retried with the retry
// ladder until it works or the consumer stops: the message is held
// meanwhile (its subscription paused), never acked unstored; a stop nacks
// it.
type poisonPublisher struct {
	chain *Chain
	d     *delivery
}

func (p *poisonPublisher) Publish(_ string, msgs ...*message.Message) error {
	c, d := p.chain, p.d
	for _, msg := range msgs {
		ctx := msg.Context()
		f := c.failureOf(msg, d)
		bo := newBackOff(c.cfg.Retry)
		for {
			err := p.store(ctx, msg, f)
			if err == nil {
				break
			}
			wait := bo.NextBackOff()
			c.stack.logger.Error("Cannot store poisoned message; holding it and trying again", err,
				c.logFields(d, watermill.LogFields{"wait": wait.String()}))
			if err := c.stack.sleep(ctx, wait); err != nil {
				return &shutdownError{cause: err}
			}
		}
		d.outcome = OutcomePoisoned
		c.stack.warn("Message poisoned", c.logFields(d, watermill.LogFields{
			"reason": f.reason, "error_class": f.class, "destination": c.cfg.Poison.Destination,
		}))
	}
	return nil
}

func (p *poisonPublisher) Close() error { return nil }

func (p *poisonPublisher) store(ctx context.Context, msg *message.Message, f failure) error {
	c := p.chain
	if c.cfg.Poison.Destination == PoisonToTopic {
		out := msg.Copy()
		for k, v := range f.metadata() {
			out.Metadata.Set(k, v)
		}
		out.SetContext(ctx)
		if err := c.stack.poison.Publish(c.cfg.Poison.Topic, out); err != nil {
			return fmt.Errorf("publish to poison topic %s: %w", c.cfg.Poison.Topic, err)
		}
		return nil
	}
	return c.storePoisoned(ctx, msg, f)
}

// watermillPoisonKeys are set on the message by Watermill's poison queue;
// the table has columns for them.
var watermillPoisonKeys = []string{wmw.ReasonForPoisonedKey, wmw.PoisonedTopicKey, wmw.PoisonedHandlerKey, wmw.PoisonedSubscriberKey}

// storePoisoned upserts the message into the poison table: poisoning the same
// message (or a replay of it, see ReplayOfKey) for the same handler again
// refreshes its row and counts it.
func (c *Chain) storePoisoned(ctx context.Context, msg *message.Message, f failure) error {
	meta := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		meta[k] = v
	}
	for _, k := range watermillPoisonKeys {
		delete(meta, k)
	}
	messageID := cmp.Or(msg.Metadata.Get(ReplayOfKey), msg.UUID)
	if messageID == "" {
		messageID = watermill.NewUUID()
	}
	return c.savePoisoned(ctx, msg, store.Poisoned{
		ConsumerGroup: f.consumerGroup, Handler: f.handler, SourceTopic: f.sourceTopic,
		MessageID: messageID, EventID: eventIDOf(msg), EventType: msg.Metadata.Get(envelope.EventTypeKey),
		Payload: msg.Payload, Metadata: meta, Reason: f.reason, ErrorClass: f.class, Attempts: f.attempts,
		FirstFailureAt: f.firstFailure, LastFailureAt: f.lastFailure, Traceparent: f.traceparent, PoisonedAt: f.poisonedAt,
	})
}
