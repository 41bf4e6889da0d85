// Package wal is the source of a relay that reads the write-ahead log
// instead of polling the outbox table: it streams the outbox's inserts, and
// logical messages written with pg_logical_emit_message, through a logical
// replication slot with the pgoutput plugin and a publication on the outbox
// table, on a replication connection (github.com/jackc/pglogrepl).
//
// # Requirements
//
// The server runs with wal_level = logical (a setting that changes only at
// server start) and max_replication_slots and max_wal_senders above zero;
// the role has the REPLICATION privilege (ALTER ROLE ... REPLICATION).
// [Check] says which is missing and how to fix it; [New] calls it first.
// The publication must exist, or the role own the outbox table and have
// CREATE on the database for New to create it: [PublicationSQL] is the
// statement an operator runs otherwise.
//
// # Order and acknowledgement
//
// pgoutput sends a transaction once it has committed, whole, in commit
// order: a transaction that began first but committed last comes last, and
// a transaction still open holds back nothing committed after it. The
// [Reader] hands consecutive committed transactions to its [Handler] as a
// [Batch], one batch at a time; transactions are never split. The Handler
// returns nil only once the broker has confirmed every event of the batch,
// and only then does the Reader count the batch's LSN as confirmed: the
// standby status updates it sends carry, as their flush position, the end
// of the last transaction acknowledged that way, so the slot's
// confirmed_flush_lsn never passes an event the broker has not confirmed.
// A restart resumes from the slot's confirmed_flush_lsn: the events of
// batches handed out but not acknowledged come again (duplicates, never
// loss).
//
// # Heartbeats
//
// The Reader sends a standby status update at least every
// Config.StatusInterval, and never less often than half of the server's
// wal_sender_timeout, also while idle or while the Handler waits on the
// broker. When every transaction handed out has been acknowledged and none
// is half received, it confirms the position of the server's keepalives
// too, so the slot of a database whose writes never touch the outbox keeps
// advancing and retains no WAL.
//
// # The slot's lifecycle
//
// New creates the publication and the slot when they are missing. A slot
// starts at the moment it is created: events committed before are not in
// it. A slot PostgreSQL has invalidated (pg_replication_slots.wal_status
// 'lost', when max_slot_wal_keep_size was passed) can never be read again;
// New and Run say so with [ErrSlotLost]. [Status] reports a slot's retained
// WAL and state, and [DropSlot] removes a slot no relay uses any more: an
// abandoned slot keeps WAL on the server's disk without limit.
//
// The forwarder's relay.source: wal runs a Reader while it holds the
// outbox's lease (see forwarder.Config.Source and docs/WAL.md).
package wal
