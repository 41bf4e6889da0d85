// Package kafkadev is the in-process Kafka-protocol dev cluster (franz-go's
// kfake) for development, tests and demos; production programs do not import
// it.
//
// Start runs a cluster inside the process. Importing the package (import _
// ".../adapters/kafka/kafkadev") also lets broker.kafka.dev_cluster: true
// start one from config, as importing a database/sql driver registers it;
// several Brokers opened in one process on the same dev_cluster config share
// one cluster, which stops with the last Close. A program that does not
// import it links no kfake, and a config that asks for the dev cluster there
// is an error naming broker.kafka.dev_cluster.
package kafkadev
