package nats

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace-io/millrace/adapters"
)

// codeSubjectOverlap is the JetStream API error "subjects overlap with an
// existing stream".
const codeSubjectOverlap = 10065

// withinConnectTimeout runs f with a context that ends after
// connect_timeout.
func (b *Broker) withinConnectTimeout(f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), b.opts.ConnectTimeout)
	defer cancel()
	return f(ctx)
}

// Provision makes topic's stream and a durable consumer for each of
// consumerGroups exist with the configured settings; a consumer it creates
// delivers the stream from its first message (DeliverAll). It is
// idempotent. An existing stream or consumer with other settings is left
// alone and reported (wrapping adapters.ErrTopologyConflict) with each
// difference; so is a server that silently ignored a setting. Both, and a
// topic or group that is not a valid name, are permanent errors
// (adapters.IsPermanent): retrying cannot fix them.
func (b *Broker) Provision(ctx context.Context, topic string, consumerGroups ...string) error {
	return b.provision(ctx, topic, adapters.StartAll, consumerGroups...)
}

// ProvisionGroup is Provision for one group, whose consumer, when it
// creates it, starts at group.Start: after the last message the stream
// holds then (adapters.StartNew: DeliverByStartSequence, the sequence
// after it, which the consumer's config keeps, so that a later start from
// an ack floor, as an ordered subscriber's, never goes back before it) or
// at its first message (DeliverAll). An existing consumer keeps its
// position. With group.Ordered (adapters.Capabilities.OrderedGroups) a
// missing consumer is made with max_ack_pending 1 and an existing one is
// taken as it is whatever its max_ack_pending, deliver policy and deliver
// subject, which the group's ordered subscription sets whenever it takes
// the group over (subscribeOrdered); the Broker remembers the group for its
// later Provision and Subscriber calls. See adapters.Broker.
func (b *Broker) ProvisionGroup(ctx context.Context, topic string, group adapters.GroupSpec) error {
	if group.Ordered {
		if err := b.markOrdered(topic, group.Name); err != nil {
			return err
		}
	}
	return b.provision(ctx, topic, group.Start, group.Name)
}

// provision is Provision, with new consumers starting at start.
func (b *Broker) provision(ctx context.Context, topic string, start adapters.Start, consumerGroups ...string) error {
	if err := checkTopic(topic); err != nil {
		return adapters.Permanent(err)
	}
	for _, g := range consumerGroups {
		if err := checkGroup(g); err != nil {
			return adapters.Permanent(err)
		}
	}
	if err := b.ensureStream(ctx, topic); err != nil {
		return err
	}
	for _, g := range consumerGroups {
		if err := b.ensureConsumer(ctx, topic, g, start); err != nil {
			return err
		}
	}
	return nil
}

// streamConfig is the stream millrace wants for topic. It sets only fields
// nats-server 2.9 knows, because older servers ignore unknown fields without
// an error; verifyStream then checks the server kept each one.
func (b *Broker) streamConfig(topic string) jetstream.StreamConfig {
	sc := b.cfg.Stream
	maxBytes := sc.MaxBytes
	if maxBytes == 0 {
		maxBytes = -1
	}
	maxMsgSize := sc.MaxMsgSize
	if maxMsgSize == 0 {
		maxMsgSize = -1
	}
	return jetstream.StreamConfig{
		Name:        StreamName(topic),
		Description: "millrace topic " + topic,
		Subjects:    []string{topic},
		Retention:   jetstream.LimitsPolicy,
		Storage:     jetstream.FileStorage,
		Replicas:    sc.Replicas,
		MaxAge:      sc.MaxAge,
		MaxBytes:    maxBytes,
		MaxMsgs:     -1,
		Discard:     jetstream.DiscardNew,
		Duplicates:  sc.DuplicateWindow,
		MaxMsgSize:  maxMsgSize,
	}
}

// consumerConfig is the durable push consumer millrace wants for group on
// topic: explicit acks, every message from the start of the stream (see
// ensureConsumer for a group that starts new), and a deliver group so the
// group's subscribers compete.
func (b *Broker) consumerConfig(topic, group string) jetstream.ConsumerConfig {
	cc := b.cfg.Consumer
	name := ConsumerName(group)
	return jetstream.ConsumerConfig{
		Durable:        name,
		Description:    "millrace consumer group " + group + " of topic " + topic,
		DeliverSubject: deliverSubject(StreamName(topic), name),
		DeliverGroup:   name,
		DeliverPolicy:  jetstream.DeliverAllPolicy,
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        cc.AckWait,
		MaxDeliver:     cc.MaxDeliver,
		MaxAckPending:  b.maxAckPending(topic, group),
		ReplayPolicy:   jetstream.ReplayInstantPolicy,
	}
}

// ensureStream creates topic's stream if it is missing and checks it
// against the config. A stream found good is remembered until a publish says
// it is gone.
func (b *Broker) ensureStream(ctx context.Context, topic string) error {
	b.mu.Lock()
	known := b.streams[topic]
	b.mu.Unlock()
	if known {
		return nil
	}
	if err := checkTopic(topic); err != nil {
		return adapters.Permanent(err)
	}
	want := b.streamConfig(topic)
	s, err := b.js.Stream(ctx, want.Name)
	created := false
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		s, err = b.js.CreateStream(ctx, want)
		created = err == nil
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			s, err = b.js.Stream(ctx, want.Name) // created meanwhile, maybe by another process
		}
	}
	if err != nil {
		if apiErrorCode(err) == codeSubjectOverlap {
			return adapters.Permanent(fmt.Errorf("nats: stream %q for topic %q: another stream already captures subject %q: %w",
				want.Name, topic, topic, adapters.ErrTopologyConflict))
		}
		return fmt.Errorf("nats: provisioning stream %q for topic %q: %w", want.Name, topic, err)
	}
	if diffs := diffStream(want, s.CachedInfo().Config); len(diffs) > 0 {
		return b.conflict(created, "stream", fmt.Sprintf("stream %q", want.Name), topic, diffs)
	}
	b.mu.Lock()
	b.streams[topic] = true
	b.mu.Unlock()
	return nil
}

// forgetStream makes the next publish to topic check its stream again.
func (b *Broker) forgetStream(topic string) {
	b.mu.Lock()
	delete(b.streams, topic)
	for k := range b.consumers {
		if strings.HasPrefix(k, topic+"\x00") {
			delete(b.consumers, k)
		}
	}
	b.mu.Unlock()
}

// ensureConsumer creates group's durable consumer on topic's stream, starting
// at start, if it is missing and checks it against the config. The consumer
// must exist before a subscription binds to it: a consumer that nats.go
// creates itself is deleted when the subscription ends, taking the group's
// position with it.
func (b *Broker) ensureConsumer(ctx context.Context, topic, group string, start adapters.Start) error {
	key := topic + "\x00" + group
	b.mu.Lock()
	known := b.consumers[key]
	b.mu.Unlock()
	if known {
		return nil
	}
	want := b.consumerConfig(topic, group)
	stream := StreamName(topic)
	c, err := b.js.PushConsumer(ctx, stream, want.Durable)
	created := false
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		// Look first, create only when missing: nats-server 2.9 ignores the
		// create-only flag and would update an existing consumer instead.
		c, created, err = b.createConsumer(ctx, stream, want, start)
	}
	if err != nil {
		if errors.Is(err, jetstream.ErrNotPushConsumer) {
			return adapters.Permanent(fmt.Errorf("nats: consumer %q on stream %q (group %q, topic %q) is a pull consumer; millrace needs a push consumer: %w",
				want.Durable, stream, group, topic, adapters.ErrTopologyConflict))
		}
		return fmt.Errorf("nats: provisioning consumer %q on stream %q (group %q, topic %q): %w", want.Durable, stream, group, topic, err)
	}
	if diffs := diffConsumer(want, c.CachedInfo().Config, topic, b.isOrdered(topic, group)); len(diffs) > 0 {
		return b.conflict(created, "consumer", fmt.Sprintf("consumer %q on stream %q", want.Durable, stream), topic, diffs)
	}
	b.mu.Lock()
	b.consumers[key] = true
	b.mu.Unlock()
	return nil
}

// createConsumer creates want on stream, starting at start: for
// adapters.StartNew at the sequence after the last message the stream
// holds now. It reports whether this call created it (another process may
// have first).
func (b *Broker) createConsumer(ctx context.Context, stream string, want jetstream.ConsumerConfig, start adapters.Start) (jetstream.PushConsumer, bool, error) {
	if start == adapters.StartNew {
		s, err := b.js.Stream(ctx, stream)
		if err != nil {
			return nil, false, err
		}
		info, err := s.Info(ctx)
		if err != nil {
			return nil, false, err
		}
		want.DeliverPolicy, want.OptStartSeq = jetstream.DeliverByStartSequencePolicy, info.State.LastSeq+1
	}
	c, err := b.js.CreatePushConsumer(ctx, stream, want)
	if err == nil {
		return c, true, nil
	}
	// Another process may have created the group between our read of the
	// stream and this create: with consumer.start new both ask for their own
	// start sequence, and the server refuses the second as an update of the
	// deliver policy (error 10012) rather than as ErrConsumerExists. The
	// group exists then, and the caller compares its settings.
	existing, getErr := b.js.PushConsumer(ctx, stream, want.Durable)
	if getErr == nil {
		return existing, false, nil
	}
	return nil, false, err
}

// conflict builds the error for a stream or consumer that differs from the
// config: existing before (someone else's settings) or just created (the
// server dropped or changed a setting).
func (b *Broker) conflict(created bool, kind, what, topic string, diffs []string) error {
	if created {
		return adapters.Permanent(fmt.Errorf("nats: the server (version %s) did not apply every setting of the new %s for topic %q: %s; it may be too old for them: %w",
			b.nc.ConnectedServerVersion(), what, topic, strings.Join(diffs, "; "), adapters.ErrTopologyConflict))
	}
	return adapters.Permanent(fmt.Errorf("nats: %s for topic %q exists with settings other than broker.nats: %s; change the config or the %s (nats %s edit, or delete it) so they agree: %w",
		what, topic, strings.Join(diffs, "; "), kind, kind, adapters.ErrTopologyConflict))
}

// diffStream lists each field millrace sets whose value on the server (got)
// differs from want.
func diffStream(want, got jetstream.StreamConfig) []string {
	var d diffs
	if !slices.Equal(want.Subjects, got.Subjects) {
		d.add("subjects", got.Subjects, want.Subjects, "")
	}
	d.check("retention", got.Retention, want.Retention, "")
	d.check("storage", got.Storage, want.Storage, "")
	d.check("replicas", got.Replicas, want.Replicas, "stream.replicas")
	d.check("max_age", got.MaxAge, want.MaxAge, "stream.max_age")
	d.check("max_bytes", got.MaxBytes, want.MaxBytes, "stream.max_bytes (0 in config is -1 on the server)")
	d.check("max_msgs", got.MaxMsgs, want.MaxMsgs, "")
	d.check("discard", got.Discard, want.Discard, "")
	d.check("duplicate_window", got.Duplicates, want.Duplicates, "stream.duplicate_window")
	d.check("max_msg_size", got.MaxMsgSize, want.MaxMsgSize, "stream.max_msg_size (0 in config is -1 on the server)")
	return d
}

// diffConsumer is diffStream for consumers.
// A filter equal to the topic is the same as none: the stream holds only it.
// The deliver policy is not compared: it is where the group started when it
// was created (consumer.start then), and an ordered group's ordered
// subscriber sets it to its ack floor, as it sets its max_ack_pending
// (subscribeOrdered), which is not compared either.
func diffConsumer(want, got jetstream.ConsumerConfig, topic string, ordered bool) []string {
	var d diffs
	if got.DeliverSubject == "" {
		d = append(d, "it has no deliver subject (a pull consumer); millrace subscribes to push consumers")
	}
	d.check("deliver_group", got.DeliverGroup, want.DeliverGroup, "")
	d.check("ack_policy", got.AckPolicy, want.AckPolicy, "")
	d.check("ack_wait", got.AckWait, want.AckWait, "consumer.ack_wait")
	d.check("max_deliver", got.MaxDeliver, want.MaxDeliver, "consumer.max_deliver")
	if !ordered {
		d.check("max_ack_pending", got.MaxAckPending, want.MaxAckPending, "consumer.max_ack_pending; a handler with consumer.ordered: true has its consumer.prefetch")
	}
	d.check("replay_policy", got.ReplayPolicy, want.ReplayPolicy, "")
	if got.FilterSubject != "" && got.FilterSubject != topic {
		d.add("filter_subject", got.FilterSubject, "none", "")
	}
	if len(got.FilterSubjects) > 0 {
		d.add("filter_subjects", got.FilterSubjects, "none", "")
	}
	return d
}

type diffs []string

func (d *diffs) add(field string, got, want any, key string) {
	s := fmt.Sprintf("%s is %v on the server, %v wanted", field, got, want)
	if key != "" {
		s += " (broker.nats." + key + ")"
	}
	*d = append(*d, s)
}

func (d *diffs) check(field string, got, want any, key string) {
	if got != want {
		d.add(field, got, want, key)
	}
}

// Deprovision deletes topic's stream, and with it the consumers of every
// group and the messages it holds, and the leases of consumerGroups (see
// subscribeOrdered). A stream already gone is not an error. See
// adapters.Broker.
func (b *Broker) Deprovision(ctx context.Context, topic string, consumerGroups ...string) error {
	if err := checkTopic(topic); err != nil {
		return adapters.Permanent(err)
	}
	b.forgetStream(topic)
	if err := b.js.DeleteStream(ctx, StreamName(topic)); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("nats: delete stream %q of topic %q: %w", StreamName(topic), topic, err)
	}
	return b.forgetLeases(ctx, topic, consumerGroups)
}
