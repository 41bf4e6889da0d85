package rabbit

import (
	"context"
	"errors"
	"fmt"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/names"
)

// Names of the RabbitMQ objects behind a topic and its consumer groups.
// Topics and groups never contain ':' (names.Topic refuses it), so these
// names cannot collide with each other.
//
//	exchange  <topic>              fanout; alternate-exchange <topic>:unrouted
//	exchange  <topic>:unrouted     fanout, internal: the alternate exchange
//	queue     <topic>::unrouted    quorum: what reached <topic> while no group queue was bound
//	exchange  <topic>:dlx          direct: dead letters of every group of the topic
//	queue     <topic>:<group>      quorum: the consumer group's queue
//	queue     <topic>:<group>:dlq  quorum: the group's dead letters (routing key <group>)
//	queue     <topic>:<group>:retry  quorum: messages waiting for their next delivery
//	                                 (a RedeliveryWait); expired ones go back to <topic>:<group>

// QueueName is the quorum queue consumer group group reads topic from.
func QueueName(topic, group string) string { return topic + ":" + group }

// DeadLetterQueueName is the quorum queue that receives group's messages of
// topic that exceeded Config.DeliveryLimit (or were rejected without requeue).
func DeadLetterQueueName(topic, group string) string { return QueueName(topic, group) + ":dlq" }

// RetryQueueName is the quorum queue where a subscription of group with a
// RedeliveryWait parks a nacked message of topic until its wait (the
// message's expiration) ends; RabbitMQ then dead-letters it back to
// QueueName(topic, group).
func RetryQueueName(topic, group string) string { return QueueName(topic, group) + ":retry" }

// UnroutedQueueName is the quorum queue that parks messages published to
// topic while no consumer group's queue was bound to it. The empty group
// slot ("::") marks a queue that belongs to no group.
func UnroutedQueueName(topic string) string { return topic + "::unrouted" }

func unroutedExchangeName(topic string) string   { return topic + ":unrouted" }
func deadLetterExchangeName(topic string) string { return topic + ":dlx" }

// maxNameBytes is AMQP's limit on exchange and queue names (short strings).
const maxNameBytes = 255

// checkNames validates topic and groups and the lengths of the names derived
// from them.
func checkNames(topic string, groups ...string) error {
	if err := names.Topic(topic); err != nil {
		return adapters.Permanent(fmt.Errorf("rabbitmq: topic %q: %w", topic, err))
	}
	if n := len(UnroutedQueueName(topic)); n > maxNameBytes {
		return adapters.Permanent(fmt.Errorf("rabbitmq: topic %q is too long: its queue %q would be %d bytes; RabbitMQ names are at most %d bytes",
			topic, UnroutedQueueName(topic), n, maxNameBytes))
	}
	for _, g := range groups {
		if err := checkGroup(g); err != nil {
			return err
		}
		if n := len(RetryQueueName(topic, g)); n > maxNameBytes {
			return adapters.Permanent(fmt.Errorf("rabbitmq: topic %q with consumer group %q is too long: queue %q would be %d bytes; RabbitMQ names are at most %d bytes",
				topic, g, RetryQueueName(topic, g), n, maxNameBytes))
		}
	}
	return nil
}

// checkGroup validates a consumer group name.
func checkGroup(group string) error {
	if err := names.Topic(group); err != nil {
		return adapters.Permanent(fmt.Errorf("rabbitmq: consumer group %q: %w", group, err))
	}
	return nil
}

// declarer declares the topology of topics and consumer groups.
type declarer struct {
	deliveryLimit int
	// observe, when set, is told every exchange and queue declared (tests
	// use it to delete what they created).
	observe func(kind, name string)
}

// quorum are the arguments of every queue this adapter declares.
func quorum() amqp.Table { return amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum} }

// groupQueueArgs are the arguments of a consumer group's queue. At-least-once
// dead-lettering keeps a dead letter in the source queue until its
// dead-letter queue confirmed it; RabbitMQ honours it only together with
// x-overflow reject-publish and silently falls back to at-most-once (a dead
// letter is dropped when it cannot be routed) without it.
func (d declarer) groupQueueArgs(topic, group string) amqp.Table {
	args := quorum()
	args["x-delivery-limit"] = int64(d.deliveryLimit)
	args["x-dead-letter-exchange"] = deadLetterExchangeName(topic)
	args["x-dead-letter-routing-key"] = group
	args["x-dead-letter-strategy"] = "at-least-once"
	args[amqp.QueueOverflowArg] = amqp.QueueOverflowRejectPublish
	return args
}

// retryQueueArgs are the arguments of a consumer group's retry queue. It is
// a quorum queue like the others: since RabbitMQ 3.10 quorum queues honour a
// per-message expiration, and they dead-letter at least once (an expired
// message leaves the retry queue only once the group's queue confirmed it),
// which a classic queue cannot do. Its dead letters go through the default
// exchange straight to the group's queue. It has no delivery limit: nothing
// consumes it.
func retryQueueArgs(topic, group string) amqp.Table {
	args := quorum()
	args["x-dead-letter-exchange"] = ""
	args["x-dead-letter-routing-key"] = QueueName(topic, group)
	args["x-dead-letter-strategy"] = "at-least-once"
	args[amqp.QueueOverflowArg] = amqp.QueueOverflowRejectPublish
	return args
}

// topoChannel is the channel declarations run on. The broker closes a
// channel on a refused declaration, so channel opens a new one when needed.
type topoChannel struct {
	conn *amqp.Connection
	ch   *amqp.Channel
}

func (tc *topoChannel) channel() (*amqp.Channel, error) {
	if tc.ch == nil || tc.ch.IsClosed() {
		ch, err := tc.conn.Channel()
		if err != nil {
			return nil, fmt.Errorf("rabbitmq: open channel: %w", err)
		}
		tc.ch = ch
	}
	return tc.ch, nil
}

func (tc *topoChannel) close() {
	if tc.ch != nil {
		_ = tc.ch.Close()
	}
}

// declareTopic declares what publishing to topic needs: its exchange with
// the alternate exchange and parking queue for unroutable messages, and the
// dead-letter exchange its groups' queues name.
func (d declarer) declareTopic(tc *topoChannel, topic string) error {
	if err := d.exchange(tc, unroutedExchangeName(topic), amqp.ExchangeFanout, true, nil, "durable internal fanout exchange"); err != nil {
		return err
	}
	if err := d.queue(tc, UnroutedQueueName(topic), quorum(), "durable quorum queue"); err != nil {
		return err
	}
	if err := d.bind(tc, UnroutedQueueName(topic), "", unroutedExchangeName(topic)); err != nil {
		return err
	}
	if err := d.exchange(tc, deadLetterExchangeName(topic), amqp.ExchangeDirect, false, nil, "durable direct exchange"); err != nil {
		return err
	}
	return d.exchange(tc, topic, amqp.ExchangeFanout, false,
		amqp.Table{"alternate-exchange": unroutedExchangeName(topic)},
		fmt.Sprintf("durable fanout exchange with alternate-exchange %q", unroutedExchangeName(topic)))
}

// declareGroup declares group's queue of topic, bound to the topic exchange,
// its dead-letter queue and its retry queue. declareTopic must have run first.
func (d declarer) declareGroup(tc *topoChannel, topic, group string) error {
	dlq, q := DeadLetterQueueName(topic, group), QueueName(topic, group)
	if err := d.queue(tc, dlq, quorum(), "durable quorum queue"); err != nil {
		return err
	}
	if err := d.queue(tc, RetryQueueName(topic, group), retryQueueArgs(topic, group),
		fmt.Sprintf("durable quorum queue, dead letters to the default exchange with routing key %q, x-dead-letter-strategy at-least-once, x-overflow reject-publish", q)); err != nil {
		return err
	}
	if err := d.bind(tc, dlq, group, deadLetterExchangeName(topic)); err != nil {
		return err
	}
	want := fmt.Sprintf("durable quorum queue, x-delivery-limit %d, dead letters to exchange %q with routing key %q, x-dead-letter-strategy at-least-once, x-overflow reject-publish",
		d.deliveryLimit, deadLetterExchangeName(topic), group)
	if err := d.queue(tc, q, d.groupQueueArgs(topic, group), want); err != nil {
		return err
	}
	return d.bind(tc, q, "", topic)
}

func (d declarer) exchange(tc *topoChannel, name, kind string, internal bool, args amqp.Table, want string) error {
	d.seen("exchange", name)
	ch, err := tc.channel()
	if err != nil {
		return err
	}
	if err := ch.ExchangeDeclare(name, kind, true, false, internal, false, args); err != nil {
		if reason, ok := conflict(err); ok {
			return conflictError("exchange", name, "", reason, want)
		}
		return fmt.Errorf("rabbitmq: declare exchange %q: %w", name, err)
	}
	return nil
}

func (d declarer) queue(tc *topoChannel, name string, args amqp.Table, want string) error {
	d.seen("queue", name)
	ch, err := tc.channel()
	if err != nil {
		return err
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
		reason, ok := conflict(err)
		if !ok {
			return fmt.Errorf("rabbitmq: declare queue %q: %w", name, err)
		}
		// The broker names the first argument that differs, which for a
		// classic queue is rarely x-queue-type. Declaring with the queue
		// type alone tells whether the type itself is what differs.
		what := ""
		if pch, err := tc.channel(); err == nil {
			if _, err := pch.QueueDeclare(name, true, false, false, false, quorum()); err != nil {
				if r, ok := conflict(err); ok && strings.Contains(r, "'"+amqp.QueueTypeArg+"'") {
					what, reason = "is not a quorum queue", r
				}
			}
		}
		return conflictError("queue", name, what, reason, want)
	}
	return nil
}

func (d declarer) bind(tc *topoChannel, queue, key, exchange string) error {
	ch, err := tc.channel()
	if err != nil {
		return err
	}
	if err := ch.QueueBind(queue, key, exchange, false, nil); err != nil {
		return fmt.Errorf("rabbitmq: bind queue %q to exchange %q: %w", queue, exchange, err)
	}
	return nil
}

func (d declarer) seen(kind, name string) {
	if d.observe != nil {
		d.observe(kind, name)
	}
}

// conflict reports whether err is the broker's refusal to redeclare an
// existing object with other settings (PRECONDITION_FAILED, or
// RESOURCE_LOCKED for an exclusive queue of another connection), and its text.
func conflict(err error) (string, bool) {
	var ae *amqp.Error
	if errors.As(err, &ae) && (ae.Code == amqp.PreconditionFailed || ae.Code == amqp.ResourceLocked) {
		return ae.Reason, true
	}
	return "", false
}

// conflictError is the permanent error for an existing object whose settings
// differ; what, when known, says how ("is not a quorum queue").
func conflictError(kind, name, what, reason, want string) error {
	if what == "" {
		what = "exists with other settings"
	}
	return adapters.Permanent(fmt.Errorf(
		"rabbitmq: %s %q %s: %w: the broker says %q; millrace declares a %s. "+
			"Delete the %s (its messages go with it) or change the configuration to match",
		kind, name, what, adapters.ErrTopologyConflict, reason, want, kind))
}

// topologyConnection checks the names of topic and consumerGroups and
// returns the connection to declare or delete their topology on, with the
// function to call when done (see dropOnCancel).
func (b *Broker) topologyConnection(ctx context.Context, topic string, consumerGroups []string) (*amqp.Connection, func() bool, error) {
	if err := checkNames(topic, consumerGroups...); err != nil {
		return nil, nil, err
	}
	conn, err := b.connection(ctx)
	if err != nil {
		return nil, nil, err
	}
	return conn, b.dropOnCancel(ctx, conn), nil
}

// Deprovision deletes what Provision declared for topic and consumerGroups:
// the groups' queues, dead-letter queues and retry queues, the parking queue and the
// topic's three exchanges, with the messages they hold. Objects already gone
// are not an error. See adapters.Broker.
func (b *Broker) Deprovision(ctx context.Context, topic string, consumerGroups ...string) error {
	conn, stop, err := b.topologyConnection(ctx, topic, consumerGroups)
	if err != nil {
		return err
	}
	defer stop()
	b.mu.Lock()
	delete(b.declared, topic)
	b.mu.Unlock()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("rabbitmq: open channel: %w", err)
	}
	defer ch.Close()
	// Deleting a missing queue or exchange succeeds in RabbitMQ 3.x.
	queues := []string{UnroutedQueueName(topic)}
	for _, g := range consumerGroups {
		queues = append(queues, QueueName(topic, g), DeadLetterQueueName(topic, g), RetryQueueName(topic, g))
	}
	for _, q := range queues {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return fmt.Errorf("rabbitmq: delete queue %q: %w", q, err)
		}
	}
	for _, x := range []string{topic, unroutedExchangeName(topic), deadLetterExchangeName(topic)} {
		if err := ch.ExchangeDelete(x, false, false); err != nil {
			return fmt.Errorf("rabbitmq: delete exchange %q: %w", x, err)
		}
	}
	return nil
}
