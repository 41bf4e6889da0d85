// Package adapters is the contract every broker adapter (kafka, rabbit, nats)
// fulfils, so bus, the forwarder and the middleware can work with any of them.
//
// Each adapter turns its config section (a Section: Kind, Validate,
// ValidateConsumers, Rules, CloudEventsPrefix, Connect; bus asks it and
// never compares broker kinds) into a Broker: Watermill publishers and subscribers with
// reliable defaults, a pipelined batch publish path for the relay, and
// idempotent topology provisioning, backlog, ping and deprovisioning. A
// Broker declares what it can do (Capabilities: ordered or concurrent
// flight, scheduled redeliveries, ...) and what it carries unchanged
// (Rules: topics, header names and values, sizes), so callers never decide
// by the broker's type or name. Its one subscriber constructor takes a
// SubscriberSpec and refuses, with a *SpecError naming the field, what its
// Capabilities do not cover; a spec with a RedeliveryWait records each
// message's delivery number in Deliveries.
//
// The package also holds millrace's one error vocabulary: Permanent,
// IsPermanent and IsRetryable, and the errors every adapter returns
// (ErrClosed, ErrTopologyConflict, ErrMessageTooLarge, *RefusedError,
// *BatchError). The adaptertest package is the suite every adapter passes.
package adapters
