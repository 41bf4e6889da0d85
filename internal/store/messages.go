package store

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// MessagePrefix is the prefix of the logical messages that carry t's
// outbox with outbox.mode: wal_messages; the WAL relay of t reads those
// only.
func (t Tables) MessagePrefix() string { return "millrace:" + t.Schema + "." + t.OutboxTopic }

// walMessage is the content of one logical message: what an outbox row
// holds, its payload (the forwarder envelope, JSON) and metadata byte for
// byte (json.Unmarshal copies a RawMessage as it is).
type walMessage struct {
	UUID     string          `json:"uuid"`
	Payload  json.RawMessage `json:"payload"`
	Metadata json.RawMessage `json:"metadata"`
}

// EmitOutbox writes rows in tx as transactional logical messages under
// t's MessagePrefix, in order, in one statement (outbox.mode:
// wal_messages): each message holds what WriteOutbox would insert, the
// row's uuid, payload and metadata (json.Marshal of it, as watermill-sql
// writes it), as text, the same bytes in every query exec mode. PostgreSQL
// decodes them, in commit order, only for a slot that existed when tx
// committed.
func (t Tables) EmitOutbox(ctx context.Context, tx Execer, rows []*message.Message) error {
	contents := make([]string, len(rows))
	for i, m := range rows {
		meta, err := json.Marshal(m.Metadata)
		if err != nil {
			return fmt.Errorf("encode the metadata of %s: %w", m.UUID, err)
		}
		uuid, err := json.Marshal(m.UUID)
		if err != nil {
			return fmt.Errorf("encode %s as a logical message: %w", m.UUID, err)
		}
		// Written out rather than marshalled: json.Marshal would compact
		// and HTML-escape the payload, changing its bytes.
		contents[i] = `{"uuid":` + string(uuid) + `,"payload":` + string(m.Payload) + `,"metadata":` + string(meta) + `}`
	}
	_, err := tx.ExecContext(ctx, `SELECT pg_logical_emit_message(true, $1::text, c) FROM unnest($2::text[]) AS c`,
		t.MessagePrefix(), contents)
	if err != nil {
		return fmt.Errorf("write %d events as logical messages of %s: %w", len(rows), t.OutboxTable(), err)
	}
	return nil
}

// DecodeMessage is the outbox row a logical message written by EmitOutbox
// carries (Offset 0: it is in no table), or an error for content that is
// not one.
func DecodeMessage(content []byte) (OutboxRow, error) {
	var m walMessage
	if err := json.Unmarshal(content, &m); err != nil {
		return OutboxRow{}, fmt.Errorf("decode a logical message of the outbox: %w", err)
	}
	return OutboxRow{UUID: m.UUID, Payload: m.Payload, Metadata: m.Metadata}, nil
}
