// Package nats connects millrace to NATS JetStream through watermill-nats.
package nats
