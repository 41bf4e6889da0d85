package adapters_test

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
)

// A subscription with a RedeliveryWait records each message's delivery
// number in the spec's Deliveries while it has the message handed out; a
// consumer chain reads it as the attempt number.
func ExampleDeliveries() {
	var deliveries adapters.Deliveries
	msg := message.NewMessage("evt-1", nil)
	forget := deliveries.Record(msg, 3) // the subscription, before it hands msg out
	n, ok := deliveries.Number(msg)     // the consumer, per message
	fmt.Println(n, ok)
	forget() // the subscription, once msg is settled
	_, ok = deliveries.Number(msg)
	fmt.Println(ok)
	// Output:
	// 3 true
	// false
}
