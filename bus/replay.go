package bus

import (
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
)

// EventMetadata returns the event's own metadata on this broker out of
// delivered, the metadata of a message as a consumer received it: what
// Publish accepted, and nothing that a broker, an adapter or the consumer
// chain added on the way. A replay (the ops package) sends only that, plus its own replay markers.
//
// The event's own metadata is, by Publish's own rule, the envelope keys
// Publish writes (reservedKeys) and every other key Publish accepts as
// Event.Metadata on the broker of topic: one that checkMetadata passes and
// whose name the broker's Rules do not refuse as a header. Every header a
// broker or its adapter sets on a delivery is one its Rules refuse, because
// a message carrying it would be altered or misread: RabbitMQ's x-death,
// x-first-death-*, x-last-death-*, x-delivery-count and x-received-from and
// its adapter's x-millrace-delivery (retry queue); the Kafka retry topic's
// x-millrace-delivery and x-millrace-retry-due; every Nats-* header. The
// chain's failure envelope (poison-*) and replay markers (replay-of,
// replay-groups) are keys checkMetadata refuses.
//
// Why this rule rather than a list of the headers each broker adds: such a
// list would be a second definition beside the Rules, and a broker that
// starts adding a header would break it silently, while Publish went on
// letting users send that header for the broker to overwrite. Why not a
// record, in every message, of the keys Publish accepted: it would add a
// header to every event for the sake of an operator's replay, and events
// published before it, or by plain Watermill, would still lack it. With
// Publish's rule there is one definition, and adaptertest.DeliveryHeaders
// checks it against what each real broker adds on redelivery and on its
// retry path.
func (c BrokerConfig) EventMetadata(topic string, delivered map[string]string) message.Metadata {
	rules := c.Rules()
	own := make(message.Metadata, len(delivered))
	for k, v := range delivered {
		if reservedKeys[k] || publishAccepts(topic, k, v, rules) {
			own[k] = v
		}
	}
	return own
}

// publishAccepts reports whether Publish accepts the entry k: v of
// Event.Metadata for topic on a broker with rules.
func publishAccepts(topic, k, v string, rules adapters.Rules) bool {
	if checkMetadata(k, v) != nil {
		return false
	}
	probe := message.NewMessage("probe", nil)
	probe.Metadata.Set(k, v)
	var refused *adapters.RefusedError
	if errors.As(rules.CheckMessage(topic, probe), &refused) {
		return refused.Part != adapters.PartHeaderName || refused.Key != k
	}
	return true
}

// CheckLimits refuses msg as Publish would: a payload over
// outbox.max_payload_bytes, or metadata (the envelope keys included) over
// outbox.max_metadata_bytes. The error matches ErrPayloadTooLarge or
// ErrMetadataTooLarge.
func (c OutboxConfig) CheckLimits(msg *message.Message) error {
	if err := c.checkPayloadSize(msg.Payload); err != nil {
		return err
	}
	return c.checkMetadataSize(msg.Metadata)
}
