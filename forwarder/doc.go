// Package forwarder is millrace's relay: it moves committed events from the
// outbox table to the broker, fast, in order and without loss.
//
// # Why not Watermill's forwarder
//
// Watermill's components/forwarder publishes one message at a time and waits
// for each broker confirm, and its SQL subscriber polls once a second. This
// relay keeps Watermill's formats and queries but publishes each batch
// pipelined through the adapter's PublishBatch and acks the batch once.
//
// # The read rule
//
// The relay waits for no transaction that is not its own. Its position (a
// store.Position, in its cursor row) is an outbox offset L, a set P of
// pending transactions, each with the offset up to which its rows were
// forwarded, and a horizon H, a transaction id. Its invariant: every
// committed row at or below L has been forwarded, except the rows of a
// transaction in P above its done offset and the rows of transactions from
// H on, none of which has been forwarded.
//
// A read is one statement, so under one snapshot S, and holds no
// transaction open: it returns the committed rows above L, those of P's
// transactions above their done offset and at or below L, and those of
// transactions from H on at or below L (the young ones), in offset order,
// up to batch_size, with S. Rows of a transaction still in progress are
// invisible to it and it does not wait for them.
//
// After the broker confirmed a prefix of the batch ending at offset F, the
// position becomes L' = max(L, F), H' = xmax of S, and P' is: P's
// transactions still in progress at S, unchanged; P's and the young
// transactions that had ended, with their done offset raised to F (to L'
// when the read returned everything it could and all of it was confirmed),
// kept while it is below L'; the young transactions in progress, from offset
// 0; and, when L' > L, every transaction S lists as in progress, from
// offset L.
//
// Why no committed row is skipped. Take a committed row r at or below L'
// that was not forwarded. If r is above L: r's offset was drawn when r was
// inserted, before the row at F was (offsets are drawn in order), and that
// row's transaction had committed before S. So r's transaction had begun
// writing before S: at S it had committed (then r was visible, in the
// batch below F, and forwarded), or it had rolled back (then r does not
// exist), or it was in progress: listed in S (added to P' from L) or with
// an id at or past S's xmax, which H' covers (a snapshot lists only the
// transactions below its xmax, the latest ended one plus one; and an
// INSERT draws the offset before it takes its transaction's id, which is
// then past xmax too). If r is at or below L, the
// invariant before the read says r's transaction is in P or at or past H.
// If it had ended at S, r was visible, among the pending or young rows of
// the read; those up to F were forwarded and P' keeps the transaction with
// done F while any of its rows can lie above. If it was in progress at S,
// P' keeps it unchanged (in P, or from 0 as a young one, or under H'). In
// every case the invariant holds for L', P', H', and a row leaves it only
// by being confirmed. The rule's bookkeeping is store.Position.Advance; a
// randomized test interleaves thousands of transactions, rollbacks, long
// ones and relay kills against it (internal/store).
//
// Order. Rows leave in offset order within a read, and a transaction that
// committed before a read leaves before one still in progress at it. The
// offset is drawn at insert: the events of one aggregate, written by
// transactions that lock the aggregate before they publish (as an update
// of it does), leave in their commit order, whatever the order of their
// transaction ids. A message retried after a partial failure may follow
// later messages of the same batch that were already confirmed.
//
// Cost. The rows above L come from a range scan of the (shard, "offset")
// index that stops after batch_size rows; P's rows from the primary key,
// one probe per pending transaction; the young rows from a range scan of
// the primary key from H, the rows written since the last read. P holds at
// most the transactions in progress at one time, and none while writes do
// not overlap the relay's reads (an unbroken run of offsets proves that no
// invisible row hides among those passed).
//
// # One batch
//
// The relay reads a batch, unwraps each row's Watermill forwarder
// envelope, publishes the batch through the adapter's PublishBatch (no
// transaction is open meanwhile), and records the position after the
// confirmed prefix with one UPDATE of its cursor row that names its lease's
// fence; rows to quarantine are moved aside in the same transaction. A
// failed or partial batch records the confirmed prefix and is retried from
// the first unconfirmed message, with jittered exponential backoff while
// the broker is down. Nothing the broker did not confirm is ever recorded,
// so a crash anywhere means duplicates (which the consumer's inbox
// removes), never loss.
//
// After reading a full batch the relay reads the next one at once, from the
// position the current batch leads to once the broker confirms all of it;
// so PostgreSQL reads while the broker confirms. The relay uses that read
// only if the batch was confirmed whole (the position is then the one it
// was read from); otherwise it reads again.
//
// A row that can never be published (an envelope that is not valid, a
// message over the broker's size limit) is moved to the relay quarantine
// table with the reason, counted and logged, and the rows behind it go on.
//
// # Wake-up
//
// A statement-level trigger on the outbox NOTIFYs at commit; the relay
// LISTENs and reads at once. A sharded outbox is notified per shard written
// to instead, and each notification wakes only that shard's relay. A
// fallback poll (poll_interval, 1s) covers a missed notification. An idle
// relay makes one query per poll interval, and renews its lease three times
// per lease_ttl.
//
// The relay LISTENs on Options.Direct (database.direct_url), or on its own
// pool, and checks with a NOTIFY of its own that notifications reach it. A
// pooler in transaction mode (PgBouncer, RDS Proxy) keeps no LISTEN: there
// the probe does not come back, the relay says so in its log and its status
// (Status.Polling) and wakes every poll_interval instead.
//
// # One active relay
//
// Relays of one outbox and consumer group share one cursor row, and one of
// them holds its lease: a holder, an expiry (lease_ttl after its last
// renewal, by the database's clock) and a fence, a number that grows with
// each new holder. Standbys ask for the lease every poll_interval (at most a
// fifth of lease_ttl) and take it when it has expired, when it was
// released (a clean stop releases it and NOTIFYs the standbys), or when
// the session it is tied to is gone: a relay that LISTENs on a direct
// connection ties its lease to that session, so a standby takes over as
// soon as PostgreSQL closes it (at once when the leader's process dies).
// Every write of a relay names its fence: a relay that lost its lease
// (paused past lease_ttl, cut off from the database) records nothing more
// and stops at its next write. Its last publishes may duplicate those of
// the new leader, and the consumer's inbox removes them. A position is
// recorded only over the one the relay last recorded: after a failover to
// a standby that had not received the relay's last writes, the cursor is
// behind the relay, and the new primary draws again the offsets and
// transaction ids the standby never saw, below the relay's position; the
// relay stops at its next write and starts again from the cursor, sending
// again what it had sent since. Nothing of this
// lives in a session, so the relay works through a pooler in transaction
// mode. Events leave in the order above as long as the broker keeps the
// order of a pipelined batch (each adapter does, per topic and partition
// key).
//
// # Scheduled messages
//
// Every relay, active or standby, also moves scheduled messages (written by
// bus.Schedule into a table of their own) into the outbox when they are due:
// in one transaction it deletes the due rows, FOR UPDATE SKIP LOCKED so that
// relays never wait on one another, and inserts them into the outbox in due
// order, whose trigger wakes the active relay. A crash mid-move rolls the
// whole move back. It then sleeps until the next due time, woken early by
// the NOTIFY of a newly scheduled message (recomputing its wake-up) and at
// most schedule_poll_interval (1m); rows held by another relay's move are
// left to it for 10ms. Immediate events never wait for scheduled ones: those
// are not in the outbox until due.
//
// # Shards
//
// With relay.shards N > 1 the outbox is split by PostgreSQL's hash of the
// aggregate id (a trigger sets each row's shard; no aggregate id is shard
// 0) and each shard has its own cursor row and lease. Every relay instance
// registers with a heartbeat, holds ceil(N / live instances) shards, takes
// free ones at each poll_interval and releases those above its share once
// their batch in flight is acked. A dead instance's shards are taken
// within one poll_interval after PostgreSQL closes its notification
// session, or lease_ttl after its last renewal when it had none.
// One aggregate stays in one shard, and one shard is forwarded by one relay
// at a time, so events of one aggregate keep their order through takeovers.
// A relay started with another N over rows pending under the recorded one
// refuses to start (ErrShardsChanged); docs/SHARDS.md has the procedure.
//
// # Backlog, retention, stop
//
// batch_size, max_in_flight and rate_limit bound a drain. Forwarded rows older
// than retention are deleted in batches of cleanup_batch. On cancellation the
// batch in flight gets shutdown_timeout to be confirmed and acked; after that
// it is abandoned unacked and the next relay sends it again.
//
// # Metrics
//
// millrace_relay_active, millrace_relay_pending_rows,
// millrace_relay_oldest_pending_age_seconds, millrace_relay_batches_total,
// millrace_relay_messages_forwarded_total, millrace_relay_publish_errors_total
// (by class), millrace_relay_quarantined_total,
// millrace_relay_cleanup_deleted_total,
// millrace_relay_commit_to_publish_seconds,
// millrace_relay_scheduled_moved_total, and for shards
// millrace_relay_shard_owned{shard}, millrace_relay_unowned_shards,
// millrace_relay_shard_pending_rows{shard} and
// millrace_relay_shard_oldest_pending_age_seconds{shard}.
//
// The pending-rows and oldest-age gauges are measured in the database by the
// active relay on a timer of its own (backlog_interval, 5s), whatever its
// batches are doing, so they rise while the broker is down; they count what
// `millrace outbox status` counts. A read that finds nothing pending sets
// them to 0 and makes the next count unnecessary, so an idle relay still
// makes one query per poll interval.
//
// # Reading the write-ahead log
//
// With relay.source: wal (Config.Source, SourceWAL) the active relay, holding
// the same lease, streams the outbox's inserts from a logical replication
// slot (package wal) on Options.ReplicationURL instead of reading batches
// from the table. Each batch goes through the same unwrap, publish and
// quarantine steps; once the broker confirmed it, one transaction deletes
// its rows from the outbox and moves the refused ones to the quarantine,
// and only then is the slot's flush position confirmed. With relay.shards
// above 1 it publishes each batch in that many lanes at once, by aggregate
// (the outbox table is then one shard). It adds
// millrace_relay_wal_retained_bytes. See docs/WAL.md.
package forwarder
