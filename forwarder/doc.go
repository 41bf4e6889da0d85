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
// # One batch
//
// In one REPEATABLE READ transaction the relay runs watermill-sql's batch
// query, which locks the relay's row in the offsets table (FOR UPDATE) and
// reads only rows of transactions older than every open one (the xid8 rule:
// a concurrent writer that commits later is never skipped). It unwraps each
// row's Watermill forwarder envelope, publishes the batch, and then records
// the last row the broker confirmed as its position and commits. A failed or
// partial batch acks the confirmed prefix and is retried from the first
// unconfirmed message, with jittered exponential backoff while the broker is
// down. Nothing the broker did not confirm is ever acked, so a crash anywhere
// means duplicates (which the consumer's inbox removes), never loss.
//
// After reading a full batch the relay reads the next one at once, outside
// the transaction, after the position the current batch acks when the broker
// confirms all of it, under the same xid8 rule; so PostgreSQL reads while the
// broker confirms. The next transaction locks the offsets row and uses that
// read only if the position there is the one it was read after; after a
// partial batch (or another relay's ack) it reads again under the lock.
//
// A row that can never be published (an envelope that is not valid, a
// message over the broker's size limit) is moved to the relay quarantine
// table with the reason, counted and logged, and the rows behind it go on.
//
// # Wake-up
//
// A statement-level trigger on the outbox NOTIFYs at commit; the relay
// LISTENs and reads at once. A sharded outbox is notified per shard written
// to instead, and each notification wakes only that shard's relay. A row
// committed while an older transaction of the cluster is still open stays
// invisible until that transaction ends (the xid8 rule), and its NOTIFY is
// then already spent; so after a notification, and whenever the batch query
// reports rows hidden that way, the relay polls again at 5ms, 10ms, 20ms,
// ... A fallback poll (poll_interval, 1s) covers a missed notification. An
// idle relay makes one query per poll interval.
//
// # One active relay
//
// Relays of one outbox and consumer group elect a leader with a
// session-level advisory lock held on a dedicated connection. Standbys block
// on that lock and take over as soon as PostgreSQL closes the leader's
// session (at once when its process dies; after TCP keepalive when its host
// vanishes). The offsets row lock inside every batch is a second guard: even
// two relays that both believe they lead cannot interleave batches. Events
// leave in commit order, so events of one aggregate keep their order, as long
// as the broker keeps the order of a pipelined batch (each adapter does, per
// topic and partition key). A message retried after a partial failure may
// follow later messages of the same batch that were already confirmed.
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
// 0) and each shard has its own offsets row and advisory lock. Every relay
// instance registers with a heartbeat, owns ceil(N / live instances)
// shards, takes free ones at each poll_interval and releases those above
// its share once their batch in flight is acked. A dead instance's shards
// are taken within one poll_interval after PostgreSQL closes its session.
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
package forwarder
