// Package rabbit connects millrace to RabbitMQ quorum queues through watermill-amqp.
package rabbit
