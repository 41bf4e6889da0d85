package adapters

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/internal/groupstart"
)

// Broker is one broker connection as millrace uses it. Implementations are
// safe for concurrent use.
type Broker interface {
	// Publisher publishes one call at a time, waiting for the broker's confirm.
	Publisher() message.Publisher

	// Subscriber returns a subscriber for spec.Group, handing messages out
	// and settling them as spec asks. Every group receives every message
	// of a topic (fan-out); subscribers of one group compete, so each
	// message goes to one of them. Messages are acked only by Ack: a Nack,
	// a crash or a closed subscriber means redelivery, never loss. A spec
	// the broker cannot serve (see Capabilities) is a *SpecError naming
	// the field.
	Subscriber(spec SubscriberSpec) (message.Subscriber, error)

	// PublishBatch publishes msgs pipelined (without waiting for each confirm)
	// and returns nil only when the broker confirmed every one of them. Otherwise
	// it returns a *BatchError saying which were not confirmed. Messages of one
	// topic and partition key keep their order within a batch.
	PublishBatch(ctx context.Context, msgs []Outgoing) error

	// Provision makes the topology for topic and its consumer groups exist
	// (streams, exchanges, queues, topics), idempotently. An existing topology
	// that conflicts with the configured one is an error saying what differs.
	// A group it creates starts at the broker's own default: the start of
	// the topic on NATS and Kafka, the first message after the queue exists
	// on RabbitMQ (ProvisionGroup says where).
	Provision(ctx context.Context, topic string, consumerGroups ...string) error

	// ProvisionGroup is Provision for one consumer group as a handler wants
	// it (bus.Run provisions every handler's group with it): a group that
	// does not exist yet starts at group.Start, one that exists keeps its
	// position whatever group.Start says; with group.Ordered it gets the
	// settings that keep per-key order across redeliveries where the broker
	// needs them (Capabilities.OrderedGroups). A start the broker cannot give
	// is a permanent error saying why.
	ProvisionGroup(ctx context.Context, topic string, group GroupSpec) error

	// Rules says what this broker carries unchanged; PublishBatch fails a
	// message they refuse permanently instead of sending it.
	Rules() Rules

	// Capabilities says what this broker can do beyond this contract.
	Capabilities() Capabilities

	// Backlog returns, per partition ("" for a broker without partitions),
	// the messages of topic that consumerGroup has not consumed yet: the
	// JetStream consumer's NumPending (not yet delivered), the RabbitMQ
	// queue's ready messages, Kafka's high watermark minus the group's
	// committed offset. bus.Run reports it as the millrace_consumer_backlog
	// gauge when Capabilities.Backlog says the broker can tell.
	Backlog(ctx context.Context, topic, consumerGroup string) (map[string]int64, error)

	// Ping returns nil when the broker answered within ctx, else why not,
	// for readiness checks (Capabilities.Ping). It does not create
	// topology or publish anything.
	Ping(ctx context.Context) error

	// Deprovision removes what Provision made for topic and its consumer
	// groups, messages included; what is already gone is not an error.
	// Demos and tests clean up with it; millrace's relay and consumers
	// never call it.
	Deprovision(ctx context.Context, topic string, consumerGroups ...string) error

	// Close releases every connection. It is idempotent.
	Close() error
}

// Start is where a consumer group that does not exist yet starts reading
// its topic: consumer.start in config.yaml.
type Start = groupstart.Start

const (
	// StartNew starts a new group after the last message the topic holds
	// when the group is created: it gets every message published from then
	// on, none from before. A group is created when it is first
	// provisioned, which bus.Run does before it relays or consumes.
	StartNew = groupstart.New
	// StartAll starts a new group at the oldest message the topic still
	// holds (its retention decides how far back that is). RabbitMQ cannot:
	// a queue holds only what was routed to it after it was bound.
	StartAll = groupstart.All
)

// GroupSpec is a consumer group as a handler wants it provisioned.
type GroupSpec struct {
	// Name is the consumer group.
	Name string
	// Start is where the group starts if it does not exist yet.
	Start Start
	// Ordered asks for the settings that keep per-key order across
	// redeliveries (consumer.ordered).
	Ordered bool
}

// Capabilities are what a broker can do beyond the contract, as it is
// configured. Consumers decide from them, never from the broker's type or
// name; Broker.Subscriber refuses a SubscriberSpec they do not cover.
type Capabilities struct {
	// KeyPartitioned: one subscription delivers messages of different
	// partition keys concurrently and those of one key in order (Kafka: one
	// message in flight per partition, and the key picks the partition), so
	// one subscription gives ordered concurrency.
	KeyPartitioned bool
	// DeduplicatesByID: the broker stores a message once when it is
	// published again with the same id within a window (JetStream's
	// Nats-Msg-Id), so a relay's re-sent batch does not reach consumers twice.
	DeduplicatesByID bool
	// OrderedFlight: Subscriber serves SubscriberSpec.Ordered, one
	// subscription having many messages in flight and keeping their order
	// across nacks and restarts (RabbitMQ: delivery tags acked one by one
	// on a quorum queue; Kafka: reading ahead of the committed offset;
	// NATS: one process of a group consumes at a time, holding a lease).
	OrderedFlight bool
	// ConcurrentFlight: Subscriber serves an unordered SubscriberSpec with
	// InFlight above 0, where the stock subscription holds one message at a
	// time (per partition on Kafka).
	ConcurrentFlight bool
	// ScheduledRedelivery: Subscriber serves a SubscriberSpec with a
	// RedeliveryWait: the broker waits before it delivers a nacked message
	// again, per message, and counts each message's deliveries itself,
	// across consumer restarts (JetStream's NakWithDelay and NumDelivered;
	// a RabbitMQ retry queue with per-message expiration and a delivery
	// header; Kafka's retry topics). It says what is configured now:
	// false on a broker that could but is not set to (Kafka with
	// broker.kafka.retry_topics off).
	ScheduledRedelivery bool
	// RedeliveryNeedsFlight: ScheduledRedelivery only with InFlight above 0
	// (Kafka: its retry topics work on the read-ahead subscription).
	RedeliveryNeedsFlight bool
	// OrderedGroups: an ordered group needs settings of its own to keep
	// per-key order across redeliveries, which ProvisionGroup with
	// GroupSpec.Ordered gives it (NATS: a consumer with max_ack_pending 1);
	// brokers that keep that order anyway (Kafka re-reads from the
	// committed offset; a RabbitMQ queue returns an unacked message to its
	// head) do not need it.
	OrderedGroups bool
	// Backlog: Broker.Backlog reports how far a group is behind.
	Backlog bool
	// Ping: Broker.Ping tells whether the broker answers right now.
	Ping bool
}

// Section is one broker's section of config.yaml (kafka.Config,
// rabbit.Config, nats.Config), as bus selects it by broker.kind: how to
// check it, what the broker carries unchanged, and how to connect. bus
// asks the section, never compares kinds.
type Section interface {
	// Kind is the broker.kind that selects the section, and its key under
	// broker in config.yaml: "kafka", "rabbitmq" or "nats".
	Kind() string
	// ValidateConsumers returns the problems of the consumers that the
	// consumer section configures on this broker with the section at path
	// (a setting the broker cannot give, or one of the section that would
	// fail them), each a *confload.FieldError naming its YAML path.
	ValidateConsumers(path string, consumers []ConsumerSettings) []error
	// CloudEventsPrefix is the header prefix of the broker's CloudEvents
	// protocol binding (outbox.cloudevents): "ce_" (Kafka), "cloudEvents_"
	// (AMQP), "ce-" (NATS).
	CloudEventsPrefix() string
	// Validate returns every problem of the section at path, each a
	// *confload.FieldError naming its YAML path. Call it on a section that
	// has had its defaults applied.
	Validate(path string) []error
	// Rules says what the broker carries unchanged with this section.
	Rules() Rules
	// Connect connects with the section, which Validate accepted; the
	// package's Open applies the defaults and validates first.
	Connect(ctx context.Context, opts Options) (Broker, error)
}

// ConsumerSettings are the settings of the consumer section, or of one
// handler's override under consumer.handlers, that a Section checks
// (Section.ValidateConsumers).
type ConsumerSettings struct {
	// Path is the YAML path of the settings: "consumer" or
	// "consumer.handlers.<name>".
	Path string
	// Start is the start set at Path (consumer.start), "" where a handler's
	// override leaves it to the consumer section.
	Start Start
	// ScheduledRetries: the handler's attempts are broker deliveries (an
	// unordered handler whose retry.mode is not process), so the broker
	// waits between them.
	ScheduledRetries bool
	// MaxAttempts is retry.max_attempts.
	MaxAttempts int
}

// Outgoing is one message of a batch and the topic it goes to.
type Outgoing struct {
	Topic string
	Msg   *message.Message
}

// Options are the settings shared by every adapter's constructor.
type Options struct {
	// Logger receives the adapter's and Watermill's logs. Defaults to no logging.
	Logger watermill.LoggerAdapter
	// ConnectTimeout bounds connecting at start (broker.connect_timeout).
	// Defaults to 10s.
	ConnectTimeout time.Duration
}

// WithDefaults returns o with every unset field at its default.
func (o Options) WithDefaults() Options {
	if o.Logger == nil {
		o.Logger = watermill.NopLogger{}
	}
	if o.ConnectTimeout <= 0 {
		o.ConnectTimeout = 10 * time.Second
	}
	return o
}

// BatchError reports the messages of a PublishBatch call the broker did not
// confirm.
type BatchError struct {
	// Errs has one entry per message of the batch: nil when the broker
	// confirmed it, the reason otherwise.
	Errs []error
}

// NewBatchError returns a *BatchError, or nil when every entry of errs is nil.
func NewBatchError(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return &BatchError{Errs: errs}
		}
	}
	return nil
}

// FailAll returns a *BatchError in which all n messages failed with err.
func FailAll(n int, err error) error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return &BatchError{Errs: errs}
}

// FirstUnconfirmed is the index of the first message that was not confirmed:
// everything before it was. It is len(Errs) when all were confirmed.
func (e *BatchError) FirstUnconfirmed() int {
	for i, err := range e.Errs {
		if err != nil {
			return i
		}
	}
	return len(e.Errs)
}

// Failed counts the messages that were not confirmed.
func (e *BatchError) Failed() int {
	n := 0
	for _, err := range e.Errs {
		if err != nil {
			n++
		}
	}
	return n
}

func (e *BatchError) Error() string {
	first := e.FirstUnconfirmed()
	if first == len(e.Errs) {
		return "batch publish: every message confirmed"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "batch publish: %d of %d messages not confirmed, first at index %d: %v",
		e.Failed(), len(e.Errs), first, e.Errs[first])
	return b.String()
}

// Unwrap returns the errors of the unconfirmed messages, so errors.Is and
// IsPermanent see them.
func (e *BatchError) Unwrap() []error {
	var out []error
	for _, err := range e.Errs {
		if err != nil {
			out = append(out, err)
		}
	}
	return out
}
