// Package kafka connects millrace to Apache Kafka through watermill-kafka (Sarama).
package kafka
