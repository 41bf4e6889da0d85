package bus

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/middleware"
)

// eventMetadata returns the event's own metadata out of delivered, the
// metadata of a message as a consumer received it: what Publish accepted,
// and nothing that a broker, an adapter or the consumer chain added on the
// way. A replay sends only that, plus its own replay markers.
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
func eventMetadata(topic string, delivered map[string]string, rules adapters.Rules) message.Metadata {
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

// replayOfDLQ reports whether msg, an outbox row's message, was written by a
// replay from the poison table: its metadata is a delivered message's.
func replayOfDLQ(msg *message.Message) bool {
	_, ok := msg.Metadata[middleware.ReplayOfKey]
	return ok
}

// replayMarkers are the metadata keys a replay from the poison table adds
// to the event's own metadata.
var replayMarkers = []string{middleware.ReplayOfKey, middleware.ReplayGroupsKey}

// ownMetadataOfReplay rewrites the envelope of an outbox row written by a
// replay from the poison table (replayOfDLQ) to carry the event's own
// metadata and its replay markers only. Rows written before replays did so
// carry the headers of the delivery they came from, and no replay-groups:
// they get groups, the consumer groups the replay history names for them
// (when it does), so that they too reach only those groups.
func ownMetadataOfReplay(topic string, msg *message.Message, rules adapters.Rules, groups []string) ([]byte, error) {
	own := eventMetadata(topic, msg.Metadata, rules)
	for _, k := range replayMarkers {
		if v, ok := msg.Metadata[k]; ok {
			own[k] = v
		}
	}
	if _, ok := own[middleware.ReplayGroupsKey]; !ok && len(groups) > 0 {
		own[middleware.ReplayGroupsKey] = strings.Join(groups, middleware.ReplayGroupsSeparator)
	}
	msg.Metadata = own
	return envelope.Wrap(topic, msg)
}

// checkReplay runs on a replay's msg to topic the checks Publish and the
// relay would run: refused is what the configured broker's Rules refuse
// (the relay quarantines such a row), overLimit what Publish's outbox
// limits refuse (the relay passes it; a consumer whose
// consumer.max_metadata_bytes is as low poisons it again).
func (o *Ops) checkReplay(topic string, msg *message.Message) (refused, overLimit error) {
	if err := o.cfg.Outbox.checkPayloadSize(msg.Payload); err != nil {
		overLimit = err
	} else if err := o.cfg.Outbox.checkMetadataSize(msg.Metadata); err != nil {
		overLimit = err
	}
	if err := o.cfg.Broker.Rules().CheckMessage(topic, msg); err != nil {
		refused = fmt.Errorf("broker.kind %s refuses it: %w", o.cfg.Broker.Kind, err)
	}
	return refused, overLimit
}
