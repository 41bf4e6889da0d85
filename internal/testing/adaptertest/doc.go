// Package adaptertest is the contract suite every millrace broker adapter
// passes, on top of Watermill's universal pubsub/tests suite: what millrace
// adds (pipelined batch publish, per-key order, consumer-group fan-out versus
// competing consumers, redelivery after a nack, a Subscriber that serves
// every SubscriberSpec its Capabilities cover and refuses the others with a
// *adapters.SpecError naming the field, surviving a broker restart).
// It also holds the kit of the adapters' tests of ordered subscribers with
// many messages in flight (adapters.Capabilities.OrderedFlight): OrderLedger,
// PublishOrdered, StartOrdered and the load they share, ManyInFlight.
package adaptertest
