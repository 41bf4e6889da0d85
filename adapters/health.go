package adapters

import "context"

// Pinger is a Broker that can tell whether it reaches its broker right now,
// for readiness checks. Every adapter of this module implements it.
type Pinger interface {
	// Ping returns nil when the broker answered within ctx, else why not.
	// It does not create topology or publish anything.
	Ping(ctx context.Context) error
}
