// Package kafka connects millrace to Apache Kafka: it publishes through
// franz-go's kgo client and consumes through watermill-kafka (Sarama), with
// reliable defaults.
//
// # Publishing
//
// One kgo client per Broker, with the idempotent producer and acks from all
// in-sync replicas, serves both Publisher and PublishBatch. The record key
// is the event's aggregate id (metadata "aggregate-id"), placed on a
// partition as Kafka's Java client places it (murmur2), so one aggregate's
// events stay in one partition; events without an aggregate id get no key
// and spread over the partitions. Records carry watermill-kafka's format
// (see Marshaler), so its subscribers read them unchanged. PublishBatch
// hands the whole batch to the client before anything is sent, then waits
// for every acknowledgement and reports each message's outcome in a
// *adapters.BatchError. A message over broker.kafka.max_message_bytes fails
// alone, permanently (adapters.ErrMessageTooLarge); if a topic's own
// max.message.bytes is lower, the messages the broker refused together with
// the large one are sent again one by one so they still get through.
//
// # Order across broker crashes
//
// Events of one aggregate reach the partition log in the order PublishBatch
// was given them, also when brokers crash mid-publish: the producer rides
// out an outage for broker.kafka.producer_retries x producer_retry_backoff
// (2 minutes by default) with its own idempotent retries, which keep order;
// when it gives up on a record, every later record of the partition in the
// call fails with it and none of them is in the log, so the relay, which
// sends again from the first failed event, keeps the order. One publish
// runs at a time, and nothing of a call is sent before all of it is in the
// client (see PublishBatch and send). This is why the producer is kgo:
// Sarama's idempotent producer went on sending the record batches behind
// one it had given up on, and after a broker crash a later event of an
// aggregate could be in the log before an earlier one.
//
// # Consuming
//
// Subscriber(group) is a watermill-kafka subscriber, one Kafka consumer
// group per group. A group starts where it was provisioned: Provision
// commits a new group's offsets at the oldest record, ProvisionGroup at the
// oldest or at the end (consumer.start), so that its start does not depend
// on when its first consumer joins; a group nobody provisioned starts at
// the oldest record (Sarama would start at the newest and miss every
// earlier event). Each partition is
// processed one message at a time: the next message of a partition comes
// after the previous one is acked, so one aggregate's events are handled in
// order, and different partitions are handled concurrently. Offsets are
// committed only for acked messages (every broker.kafka.commit_interval and
// on close); a nack redelivers to the same subscriber; a crash, a closed
// subscriber or a rebalance redelivers what was not acked.
//
// A subscription whose adapters.SubscriberSpec has InFlight above 0, as
// bus.Run asks for, hands out many records of a partition at once (one per
// aggregate at a time when Ordered) and commits the contiguous prefix of
// acked offsets, so a handler runs consumer.workers messages at once from
// one partition. With broker.kafka.retry_topics, one with a RedeliveryWait
// parks an
// unordered handler's failed messages in a retry topic per topic and group
// (RetryTopicName) until their next attempt, with their delivery number in
// a header, so the wait holds no worker and the count survives restarts.
//
// # Topics
//
// Provision creates a topic with broker.kafka.partitions,
// replication_factor and min_insync_replicas through the admin API
// (franz-go's kadm, on the publishing client), and
// refuses an existing topic that differs (see Provision). With
// auto_provision, the first publish or subscribe on a missing topic creates
// it the same way; brokers are never asked to auto-create topics.
//
// # Dev cluster
//
// Package kafkadev runs an in-process Kafka-protocol cluster (franz-go's
// kfake) for demos and tests, with no Kafka install; importing it also lets
// broker.kafka.dev_cluster: true start one from config. This package does
// not link kfake: a config asking for the dev cluster in a program that does
// not import kafkadev is an error naming broker.kafka.dev_cluster. It is not
// Kafka: see kafkadev.Cluster and the package README for what it does and
// does not do.
package kafka
