package middleware

import (
	"encoding/json"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/names"
)

// MaxEventIDBytes is the longest event id the inbox accepts, the same limit
// bus.Publish puts on caller-chosen ids.
const MaxEventIDBytes = 128

// validate refuses a message that can never be processed before any attempt
// is made, and records the error the chain gives up with for the failure
// envelope. It sits inside the poison queue (its errors are permanent) and
// outside the retry (retrying them is pointless).
func (c *Chain) validate(next step) step {
	return func(m *inflight) error {
		d := m.d
		if err := c.check(m.msg, d.eventID); err != nil {
			d.attempts = 1
			d.failed(err, c.stack.now())
			return err
		}
		err := next(m)
		if err != nil {
			d.finalErr = err
		}
		return err
	}
}

// check returns a permanent *InvalidError naming the first field at fault.
func (c *Chain) check(msg *message.Message, eventID string) error {
	idField := "metadata." + envelope.EventIDKey
	switch {
	case eventID == "":
		return Invalid(idField, "missing: the message has no %s header and no Watermill UUID", envelope.EventIDKey)
	case len(eventID) > MaxEventIDBytes:
		return Invalid(idField, "%d bytes, the limit is %d", len(eventID), MaxEventIDBytes)
	}
	// The inbox keeps the id in a text column, which holds neither NUL nor
	// invalid UTF-8: such an id would fail every attempt.
	if err := names.Value(eventID); err != nil {
		return Invalid(idField, "%v", err)
	}
	size := 0
	for k, v := range msg.Metadata {
		size += len(k) + len(v)
	}
	if size > c.cfg.MaxMetadataBytes {
		return Invalid("metadata", "%d bytes of keys and values, the limit (consumer.max_metadata_bytes) is %d", size, c.cfg.MaxMetadataBytes)
	}
	if ct := msg.Metadata.Get(envelope.ContentTypeKey); isJSON(ct) && !json.Valid(msg.Payload) {
		return Invalid("payload", "not valid JSON (%s is %q)", envelope.ContentTypeKey, ct)
	}
	if *c.cfg.OrderingGuard {
		if _, err := aggregateVersion(msg); err != nil {
			return err
		}
		for _, key := range []string{envelope.AggregateTypeKey, envelope.AggregateIDKey} {
			if err := names.Value(msg.Metadata.Get(key)); err != nil {
				return Invalid("metadata."+key, "%v", err)
			}
		}
	}
	return nil
}

func isJSON(contentType string) bool {
	mediaType, _, _ := strings.Cut(contentType, ";")
	mediaType = strings.TrimSpace(strings.ToLower(mediaType))
	return mediaType == "application/json" || strings.HasSuffix(mediaType, "+json")
}

// aggregateVersion parses the aggregate-version header; absent means 0
// (unversioned: the ordering guard lets it through).
func aggregateVersion(msg *message.Message) (int64, error) {
	raw := msg.Metadata.Get(envelope.AggregateVersionKey)
	if raw == "" {
		return 0, nil
	}
	v, err := strconv.ParseInt(raw, 10, 64)
	if err != nil || v < 0 {
		return 0, Invalid("metadata."+envelope.AggregateVersionKey, "not a non-negative integer: %q", raw)
	}
	return v, nil
}
