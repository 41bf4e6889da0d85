// Package groupstart holds where a new consumer group starts reading its
// topic (consumer.start), shared by the adapters, which provision groups,
// and the consumer configuration, which names the setting, so that the
// consumer chain needs no import of the adapter contract. Use it as
// adapters.Start, adapters.StartNew and adapters.StartAll.
package groupstart

// Start is adapters.Start: where a consumer group that does not exist yet
// starts reading its topic.
type Start string

const (
	// New is adapters.StartNew.
	New Start = "new"
	// All is adapters.StartAll.
	All Start = "all"
)
