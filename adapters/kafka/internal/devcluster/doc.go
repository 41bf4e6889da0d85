// Package devcluster is the seam between the Kafka adapter and its
// in-process dev cluster: package kafkadev registers its starter here when a
// program imports it, and the adapter starts the cluster
// broker.kafka.dev_cluster asks for through it, so a program that does not
// import kafkadev links no kfake.
package devcluster
