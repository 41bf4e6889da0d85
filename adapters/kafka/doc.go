// Package kafka connects millrace to Apache Kafka through watermill-kafka and
// Sarama, with reliable defaults.
//
// # Publishing
//
// One idempotent producer per Broker (acks=all, Sarama's Producer.Idempotent
// with Net.MaxOpenRequests=1, retries) serves both Publisher and
// PublishBatch: its own retries never duplicate or reorder records of a
// partition. The record key is the event's aggregate id (metadata
// "aggregate-id"), placed on a partition as Kafka's Java client places it
// (murmur2), so one aggregate's events stay in one partition, in order.
// PublishBatch hands the whole batch to the producer before waiting, then
// waits for every acknowledgement and reports each message's outcome in a
// *adapters.BatchError. A message over broker.kafka.max_message_bytes fails
// alone, permanently (adapters.ErrMessageTooLarge); if a topic's own
// max.message.bytes is lower, the messages the broker refused together with
// the large one are sent again one by one so they still get through.
//
// # Consuming
//
// Subscribers are watermill-kafka subscribers, one Kafka consumer group per
// Subscriber(group). A new group starts at the oldest record (Sarama would
// start at the newest and miss every earlier event). Each partition is
// processed one message at a time: the next message of a partition comes
// after the previous one is acked, so one aggregate's events are handled in
// order, and different partitions are handled concurrently. Offsets are
// committed only for acked messages (every broker.kafka.commit_interval and
// on close); a nack redelivers to the same subscriber; a crash, a closed
// subscriber or a rebalance redelivers what was not acked.
//
// # Topics
//
// Provision creates a topic with broker.kafka.partitions,
// replication_factor and min_insync_replicas through the admin API, and
// refuses an existing topic that differs (see Provision). With
// auto_provision, the first publish or subscribe on a missing topic creates
// it the same way; brokers are never asked to auto-create topics.
//
// # Dev cluster
//
// StartDevCluster, and broker.kafka.dev_cluster: true, run an in-process
// Kafka-protocol cluster (franz-go's kfake) for demos and tests, with no
// Kafka install. It is not Kafka: see DevCluster and the package README for
// what it does and does not do.
package kafka
