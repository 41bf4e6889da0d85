package ops

import (
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/middleware"
)

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
func ownMetadataOfReplay(topic string, msg *message.Message, broker bus.BrokerConfig, groups []string) ([]byte, error) {
	own := broker.EventMetadata(topic, msg.Metadata)
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
func (c *Client) checkReplay(topic string, msg *message.Message) (refused, overLimit error) {
	overLimit = c.cfg.Outbox.CheckLimits(msg)
	if err := c.cfg.Broker.Rules().CheckMessage(topic, msg); err != nil {
		refused = fmt.Errorf("broker.kind %s refuses it: %w", c.cfg.Broker.Kind, err)
	}
	return refused, overLimit
}
