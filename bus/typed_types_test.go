package bus_test

import (
	"math"
	"strings"
)

// The event types of the typed tests: OrderPlaced in three schema versions,
// OrderCancelled on the same topic, and a Go type renamed after version 2
// shipped.

// placedV1 is OrderPlaced version 1: the total in euros.
type placedV1 struct {
	OrderID string  `json:"order_id"`
	Total   float64 `json:"total"`
}

func (placedV1) EventType() string                       { return "OrderPlaced" }
func (e placedV1) Aggregate() (string, string)           { return "order", e.OrderID }
func (placedBeforeRename) EventType() string             { return "OrderPlaced" }
func (e placedBeforeRename) Aggregate() (string, string) { return "order", e.OrderID }

// placedV2 is OrderPlaced version 2: the total in cents.
type placedV2 struct {
	OrderID    string `json:"order_id"`
	TotalCents int64  `json:"total_cents"`
}

func (placedV2) EventType() string             { return "OrderPlaced" }
func (e placedV2) Aggregate() (string, string) { return "order", e.OrderID }

// placedV3 is OrderPlaced version 3, which a version 2 consumer does not know.
type placedV3 struct {
	OrderID    string `json:"order_id"`
	TotalCents int64  `json:"total_cents"`
	Currency   string `json:"currency"`
}

func (placedV3) EventType() string             { return "OrderPlaced" }
func (e placedV3) Aggregate() (string, string) { return "order", e.OrderID }

// placedBeforeRename is placedV2 as the publishing service still calls it:
// a Go rename keeps the wire name.
type placedBeforeRename placedV2

// cancelled is OrderCancelled, on the same topic as OrderPlaced.
type cancelled struct {
	OrderID string `json:"order_id"`
	Reason  string `json:"reason"`
}

func (cancelled) EventType() string             { return "OrderCancelled" }
func (e cancelled) Aggregate() (string, string) { return "order", e.OrderID }

// upcastPlaced turns version 1 into version 2.
func upcastPlaced(v placedV1) (placedV2, error) {
	return placedV2{OrderID: v.OrderID, TotalCents: int64(math.Round(v.Total * 100))}, nil
}

// noAggregate has a wire name but no Aggregate method.
type noAggregate struct{ N int }

func (noAggregate) EventType() string { return "NoAggregate" }

// unnamed has no wire name.
type unnamed struct{ N int }

// unencodable cannot be encoded as JSON.
type unencodable struct{ F func() }

func (unencodable) EventType() string { return "Unencodable" }

func containsAll(s string, parts ...string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}
