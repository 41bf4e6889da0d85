package adapters

import (
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// SubscriberSpec is a subscription as a consumer wants it: Broker.Subscriber
// takes one. The zero value but Group is the broker's stock subscription:
// one message handed out at a time per subscription (per partition on a
// KeyPartitioned broker), a nacked message delivered again at the broker's
// own pace.
type SubscriberSpec struct {
	// Group is the consumer group. Required.
	Group string
	// Ordered asks for a subscription that hands out up to InFlight
	// messages at once, at most one per aggregate (the aggregate-id
	// header) at a time, settles each on its own, and never lets a newer
	// message pass an older one it handed out: when a message is nacked, or
	// the subscriber closes, crashes or loses its connection, the messages
	// it handed out and did not ack come back in the order they were first
	// delivered, before any newer message. Competing subscribers of one
	// group give no order between them. Needs Capabilities.OrderedFlight
	// and InFlight of at least 1.
	Ordered bool
	// InFlight is how many messages one subscription has handed out and
	// not settled at most. 0 is the stock subscription; above 0 an
	// unordered subscription hands out up to InFlight at once, in no order
	// between them, and settles each on its own (Capabilities.ConcurrentFlight).
	InFlight int
	// RedeliveryWait, when set, has the broker schedule the redeliveries:
	// a nacked message comes back after RedeliveryWait(n), n being the
	// number of the delivery that was nacked (1 for the first), counted by
	// the broker across consumer restarts. Needs
	// Capabilities.ScheduledRedelivery and an unordered spec: a message
	// waiting for its next delivery lets newer ones pass it. Nil: the
	// broker does not schedule redeliveries.
	RedeliveryWait func(delivery int) time.Duration
	// Deliveries, with RedeliveryWait, receives the delivery number of each
	// message while the subscription has it handed out. Optional.
	Deliveries *Deliveries
}

// SpecError says which field of a SubscriberSpec a broker cannot serve,
// and why. It is permanent: the same spec is refused again.
type SpecError struct {
	// Broker is the broker kind: "kafka", "rabbitmq" or "nats".
	Broker string
	// Field is the SubscriberSpec field at fault, such as "InFlight".
	Field string
	// Problem says what is wrong and what the broker can do.
	Problem string
}

func (e *SpecError) Error() string {
	return fmt.Sprintf("%s: SubscriberSpec.%s: %s", e.Broker, e.Field, e.Problem)
}

// Permanent is true: the broker refuses the same spec again.
func (e *SpecError) Permanent() bool { return true }

// CheckSpec returns a *SpecError for the first field of spec that a broker
// with caps cannot serve, for every adapter's Subscriber. maxInFlight
// bounds InFlight (0: no bound).
func CheckSpec(broker string, caps Capabilities, spec SubscriberSpec, maxInFlight int) error {
	refuse := func(field, format string, args ...any) error {
		return &SpecError{Broker: broker, Field: field, Problem: fmt.Sprintf(format, args...)}
	}
	switch {
	case spec.InFlight < 0:
		return refuse("InFlight", "must not be negative; got %d", spec.InFlight)
	case maxInFlight > 0 && spec.InFlight > maxInFlight:
		return refuse("InFlight", "must be at most %d on this broker; got %d", maxInFlight, spec.InFlight)
	case spec.Ordered && !caps.OrderedFlight:
		return refuse("Ordered", "the broker has no ordered flight (Capabilities.OrderedFlight)")
	case spec.Ordered && spec.InFlight < 1:
		return refuse("InFlight", "must be at least 1 for an ordered subscription; got %d", spec.InFlight)
	case spec.Ordered && spec.RedeliveryWait != nil:
		return refuse("RedeliveryWait", "must be nil for an ordered subscription: a message waiting for its next delivery lets newer ones pass it")
	case !spec.Ordered && spec.InFlight > 0 && !caps.ConcurrentFlight:
		return refuse("InFlight", "must be 0: the broker has no concurrent flight (Capabilities.ConcurrentFlight); got %d", spec.InFlight)
	case spec.RedeliveryWait != nil && !caps.ScheduledRedelivery:
		return refuse("RedeliveryWait", "must be nil: the broker does not schedule redeliveries as configured (Capabilities.ScheduledRedelivery)")
	case spec.RedeliveryWait != nil && spec.InFlight < 1 && caps.RedeliveryNeedsFlight:
		return refuse("InFlight", "must be at least 1 with a RedeliveryWait on this broker (Capabilities.RedeliveryNeedsFlight); got %d", spec.InFlight)
	}
	return nil
}

// Deliveries holds the delivery numbers of the messages a subscription
// with a RedeliveryWait has handed out: the subscription records each
// message's number before it hands it out and forgets it once the message
// is settled, and the consumer reads it per message (Number). One value may
// serve many subscriptions. The zero value is ready to use; a nil
// *Deliveries records nothing.
type Deliveries struct {
	numbers sync.Map // *message.Message -> int
}

// Record keeps n (1 for the first delivery) as msg's delivery number, for
// the subscription that hands msg out, and returns the function that
// forgets it, which the subscription calls once msg is settled or dropped.
func (d *Deliveries) Record(msg *message.Message, n int) (forget func()) {
	if d == nil {
		return func() {}
	}
	d.numbers.Store(msg, n)
	return func() { d.numbers.Delete(msg) }
}

// Number returns msg's delivery number as its subscription recorded it, and
// false for a message it does not hold: one of a subscription without a
// RedeliveryWait, whose redeliveries the broker does not schedule.
func (d *Deliveries) Number(msg *message.Message) (int, bool) {
	if d == nil {
		return 0, false
	}
	n, ok := d.numbers.Load(msg)
	if !ok {
		return 0, false
	}
	return n.(int), true
}
