// Package adapters is the contract every broker adapter (kafka, rabbit, nats)
// fulfils, so bus, the forwarder and the middleware can work with any of them.
//
// Each adapter turns its config section (a Section: Validate, Rules,
// Connect) into a Broker: Watermill publishers and subscribers with
// reliable defaults, a pipelined batch publish path for the relay, and
// idempotent topology provisioning. A Broker declares what it can do
// (Capabilities) and what it carries unchanged (Rules: topics, header
// names and values, sizes), so callers never decide by the broker's name.
//
// The package also holds millrace's one error vocabulary: Permanent,
// IsPermanent and IsRetryable, and the errors every adapter returns
// (ErrClosed, ErrTopologyConflict, ErrMessageTooLarge, *RefusedError,
// *BatchError). The adaptertest package is the suite every adapter passes.
package adapters
