package adapters_test

import (
	"context"
	"fmt"

	"github.com/millrace-io/millrace/adapters"
)

// A RedeliveryScheduler's subscriber numbers each delivery in the message's
// context; a consumer chain reads it as the attempt number.
func ExampleDeliveryNumber() {
	ctx := adapters.WithDeliveryNumber(context.Background(), 3)
	n, ok := adapters.DeliveryNumber(ctx)
	fmt.Println(n, ok)
	_, ok = adapters.DeliveryNumber(context.Background())
	fmt.Println(ok)
	// Output:
	// 3 true
	// false
}
