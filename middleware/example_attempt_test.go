package middleware_test

import (
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/millrace-io/millrace/middleware"
)

// A handler reads the number of its attempt at the message from its
// context: 1 at the first, one more at each retry.
func ExampleAttempt() {
	off := false
	cfg := middleware.Config{
		Inbox:   middleware.InboxConfig{Enabled: &off},
		Breaker: middleware.BreakerConfig{Enabled: &off},
		Retry:   middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond},
		Poison:  middleware.PoisonConfig{Destination: middleware.PoisonToTopic, Topic: "poison"},
	}
	stack, err := middleware.New(cfg, middleware.Deps{PoisonPublisher: gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})})
	if err != nil {
		log.Fatal(err)
	}
	chain, err := stack.Chain(middleware.Handler{Name: "billing", Topic: "orders.events", ConsumerGroup: "billing"})
	if err != nil {
		log.Fatal(err)
	}
	handle := chain.Wrap(func(msg *message.Message) error {
		attempt := middleware.Attempt(msg.Context())
		fmt.Println("attempt", attempt)
		if attempt < 3 {
			return errors.New("the payment service timed out")
		}
		return nil
	})
	fmt.Println("acked:", handle(message.NewMessage("evt-1", []byte(`{}`))) == nil)
	// Output:
	// attempt 1
	// attempt 2
	// attempt 3
	// acked: true
}
