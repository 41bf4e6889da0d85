package envelope

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
)

// BenchmarkUnwrap decodes the envelope of a typical event, as the relay
// does for every outbox row.
func BenchmarkUnwrap(b *testing.B) {
	msg := message.NewMessage("01a2330e-063f-7944-8300-a60614949a58", []byte(`{"n":0,"pad":"0123456789abcdef0123456789abcdef"}`))
	for k, v := range map[string]string{
		AggregateIDKey: "agg-0", AggregateTypeKey: "bench", AggregateVersionKey: "1", ContentTypeKey: "application/json",
		EventIDKey: msg.UUID, EventTypeKey: "BenchHappened", OccurredAtKey: "2026-12-01T19:21:26.847583409Z", SchemaVersionKey: "1",
	} {
		msg.Metadata.Set(k, v)
	}
	payload, err := Wrap("orders.events", msg)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := Unwrap(payload); err != nil {
			b.Fatal(err)
		}
	}
}
