// Package envelope holds the wire format millrace shares between the outbox
// writer, the relay and the consumer middleware: the metadata keys of an event
// and Watermill's forwarder envelope that carries the destination topic inside
// an outbox row.
package envelope
