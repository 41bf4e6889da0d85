package wal

import (
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
)

// Row is one outbox row, as inserted.
type Row struct {
	// Offset is the row's "offset" column.
	Offset int64
	// UUID is the message's uuid column.
	UUID string
	// Payload and Metadata are the JSON columns' text, byte for byte (nil
	// for NULL).
	Payload, Metadata []byte
	// TransactionID is the xid8 of the transaction that wrote the row.
	TransactionID uint64
	// CreatedAt is the created_at column, read as UTC.
	CreatedAt time.Time
	// Shard is the shard column (0 without sharding).
	Shard int
}

// Message is a logical message written with
// pg_logical_emit_message(transactional, prefix, content).
type Message struct {
	// Prefix is the message's prefix (Config.MessagePrefix).
	Prefix string
	// Content is the message's bytes, as written.
	Content []byte
}

// Event is one change of a transaction: an outbox row or a logical message.
type Event struct {
	// LSN is where the change is in the WAL.
	LSN LSN
	// Row is the inserted outbox row, or nil.
	Row *Row
	// Message is the logical message, or nil.
	Message *Message
}

// Transaction is one committed transaction's events, in the order it wrote
// them.
type Transaction struct {
	// Xid is the transaction's 32-bit id (0 for a non-transactional
	// logical message, delivered alone).
	Xid uint32
	// CommitLSN is where the commit record starts; EndLSN where it ends,
	// the position confirmed once the transaction is acknowledged.
	CommitLSN, EndLSN LSN
	// CommitTime is when the transaction committed.
	CommitTime time.Time
	// Events are the transaction's outbox rows and logical messages.
	Events []Event
}

// relation is what the decoder keeps of a pgoutput Relation message.
type relation struct {
	outbox  bool
	columns []string
}

// decoder turns pgoutput's messages (protocol version 1) into transactions.
type decoder struct {
	schema, table string
	prefix        string
	relations     map[uint32]relation
	txn           *Transaction // the transaction being received, or nil
}

func newDecoder(cfg Config) *decoder {
	schema, table := cfg.outboxTable()
	return &decoder{schema: schema, table: table, prefix: cfg.MessagePrefix, relations: map[uint32]relation{}}
}

// decode takes the pgoutput message data found at lsn and returns the
// transaction it completes, if any: a Commit's transaction or a
// non-transactional logical message. data is not kept.
func (d *decoder) decode(lsn LSN, data []byte) (*Transaction, error) {
	msg, err := pglogrepl.Parse(data)
	if err != nil {
		return nil, fmt.Errorf("wal: decode pgoutput message %q at %s: %w", data[:min(len(data), 1)], lsn, err)
	}
	switch m := msg.(type) {
	case *pglogrepl.RelationMessage:
		r := relation{outbox: m.Namespace == d.schema && m.RelationName == d.table}
		for _, c := range m.Columns {
			r.columns = append(r.columns, c.Name)
		}
		d.relations[m.RelationID] = r
	case *pglogrepl.BeginMessage:
		d.txn = &Transaction{Xid: m.Xid, CommitTime: m.CommitTime}
	case *pglogrepl.InsertMessage:
		return nil, d.insert(lsn, m)
	case *pglogrepl.LogicalDecodingMessage:
		return d.message(lsn, m)
	case *pglogrepl.CommitMessage:
		if d.txn == nil {
			return nil, fmt.Errorf("wal: commit at %s without a begin", lsn)
		}
		t := d.txn
		d.txn = nil
		t.CommitLSN, t.EndLSN, t.CommitTime = m.CommitLSN, m.TransactionEndLSN, m.CommitTime
		return t, nil
	}
	// Other messages (Type, Origin; Update, Delete and Truncate, which the
	// publication does not publish) carry nothing to relay.
	return nil, nil
}

// inTransaction tells whether a transaction is half received.
func (d *decoder) inTransaction() bool { return d.txn != nil }

// insert adds an outbox row to the transaction; rows of other tables (a
// publication an operator widened) are skipped.
func (d *decoder) insert(lsn LSN, m *pglogrepl.InsertMessage) error {
	rel, ok := d.relations[m.RelationID]
	if !ok {
		return fmt.Errorf("wal: insert at %s into relation %d that no Relation message described", lsn, m.RelationID)
	}
	if !rel.outbox {
		return nil
	}
	if d.txn == nil {
		return fmt.Errorf("wal: insert at %s outside a transaction", lsn)
	}
	row, err := decodeRow(rel.columns, m.Tuple)
	if err != nil {
		return fmt.Errorf("wal: outbox row at %s: %w", lsn, err)
	}
	d.txn.Events = append(d.txn.Events, Event{LSN: lsn, Row: row})
	return nil
}

// message adds a logical message under the configured prefix to the
// transaction, or returns a non-transactional one as a transaction of its
// own.
func (d *decoder) message(lsn LSN, m *pglogrepl.LogicalDecodingMessage) (*Transaction, error) {
	if d.prefix == "" || m.Prefix != d.prefix {
		return nil, nil
	}
	// m.Content points into the connection's buffer, which the next
	// message overwrites.
	ev := Event{LSN: m.LSN, Message: &Message{Prefix: m.Prefix, Content: append([]byte{}, m.Content...)}}
	if !m.Transactional {
		// Restarting at its LSN delivers it again: duplicates, never loss.
		return &Transaction{CommitLSN: m.LSN, EndLSN: m.LSN, Events: []Event{ev}}, nil
	}
	if d.txn == nil {
		return nil, fmt.Errorf("wal: transactional message at %s outside a transaction", lsn)
	}
	d.txn.Events = append(d.txn.Events, ev)
	return nil, nil
}

// createdAtLayout is how pgoutput writes a timestamp without time zone
// (DateStyle ISO, the walsender's default).
const createdAtLayout = "2006-01-02 15:04:05.999999999"

// decodeRow reads the outbox columns of tuple (text format) by name.
func decodeRow(columns []string, tuple *pglogrepl.TupleData) (*Row, error) {
	if tuple == nil || len(tuple.Columns) != len(columns) {
		return nil, fmt.Errorf("tuple does not match its relation's %d columns", len(columns))
	}
	row := &Row{}
	var err error
	for i, c := range tuple.Columns {
		if c.DataType == pglogrepl.TupleDataTypeNull {
			continue
		}
		text := string(c.Data)
		switch columns[i] {
		case "offset":
			row.Offset, err = strconv.ParseInt(text, 10, 64)
		case "uuid":
			row.UUID = text
		case "payload":
			row.Payload = c.Data
		case "metadata":
			row.Metadata = c.Data
		case "transaction_id":
			row.TransactionID, err = strconv.ParseUint(text, 10, 64)
		case "created_at":
			row.CreatedAt, err = time.Parse(createdAtLayout, text)
		case "shard":
			row.Shard, err = strconv.Atoi(text)
		}
		if err != nil {
			return nil, fmt.Errorf("column %s: %w", columns[i], err)
		}
	}
	return row, nil
}
