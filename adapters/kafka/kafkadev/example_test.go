package kafkadev_test

import (
	"fmt"

	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
)

// Start runs a Kafka-protocol cluster in the process, e.g. for tests; its
// Addrs are the bootstrap list for broker.kafka.brokers.
func ExampleStart() {
	dev, err := kafkadev.Start(kafkadev.Options{Brokers: 1})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dev.Close()
	fmt.Println(len(dev.Addrs()))
	// Output: 1
}
