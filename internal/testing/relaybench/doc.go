// Package relaybench measures millrace's relay against Watermill's stock
// forwarder and against a hand-written reference relay, the ceiling, on
// every broker, in one run: `make bench` runs BenchmarkRelay.
//
// Every relay of a run works on one private PostgreSQL that BenchmarkRelay
// starts before its first relay (servers.StartLogicalPostgreSQL: initdb,
// fsync off, max_connections 200, wal_level = logical), each in a schema
// of its own dropped after its run, so that their rows compare.
//
// Each relay runs in a child process (the test binary re-executed) so its
// peak RSS and its SQL statements are its own. For each broker and relay the
// benchmark commits a backlog of 50,000 events, starts the relay and times
// the drain (until the relay has no committed row left to forward, probed
// on an index: store.Tables.HasBacklog on millrace's cursors and for the
// reference, the xid8 rule on watermill-sql's offsets row for stock
// Watermill; then `millrace outbox status` must say 0 pending)
// while a consumer receives, counts the relay's SQL statements per second
// while idle, then commits a trickle of 200 events/s for 5s and one of
// 2,000 events/s for 3s, one event per transaction from several writers on
// one schedule, and measures commit-to-consumer latency at each.
//
// Last, for millrace and stock Watermill only, it measures the 200/s
// trickle again for 30s beside an open transaction (+tx): another session
// begins a transaction before the first commit, takes a transaction id
// (pg_current_xact_id(), touching no table) and stays idle in it until the
// last commit, then rolls it back; the benchmark fails if it did not stay
// open. Stock Watermill's forwarder reads only rows of transactions older
// than every open one, so each event waits for the rollback; millrace's
// relay waits for no other transaction. This adds 30s, and Watermill's
// catch-up after the rollback, per broker and relay measured.
//
// millrace-wal and millrace-walmsg are millrace with relay.source: wal,
// and with outbox.mode: wal_messages too, each with a slot of its own
// (named after its schema) that exists before the backlog is committed
// and is dropped after its run, so that the WAL it retains does not pile
// up under the relays after it; their drain ends when the consumer has
// every event.
//
// Over the backlog's commit and its drain the benchmark measures what
// PostgreSQL spent, per 10,000 events: CPU seconds, the user and system
// time in /proc of the postmaster and its children (those that exited
// meanwhile through the postmaster's cutime and cstime), and MB of WAL
// (pg_wal_lsn_diff from pg_current_wal_lsn before the commit). Each
// relay's window starts after a CHECKPOINT, so that none falls in it and
// each starts alike in full-page writes. The drain probe's statements are
// in it for the table relays; for millrace-wal, the slot's decoding of
// the backlog, which its relay streams after the table's drain, mostly is
// not.
//
// The results print as one table per broker: drain, percent of the
// reference's, p50 and p99 at each rate and beside the open transaction,
// idle statements/s, peak RSS, duplicates, PostgreSQL's CPU and WAL per
// 10,000 events, and millrace's ratios to stock Watermill (for latency,
// CPU and WAL Watermill's over millrace's: lower is better); a trickle the
// writers could not keep up is noted with the rate reached.
// The RabbitMQ consumer prefetches 500 so that it keeps up. millrace-3x8 is
// millrace as three relay processes on relay.shards: 8 (its idle
// statements and peak RSS are the three processes' sums), beside the
// single millrace relay.
//
// With MILLRACE_PERFORMANCE_DOC naming a file (`make bench` names
// docs/PERFORMANCE.md), a run that passed and measured every broker and
// relay also writes these tables there as markdown, between the lines
// "<!-- relaybench:begin" and "<!-- relaybench:end -->", leaving the rest
// of the file alone: each relay's drain and share of the reference's, the
// latencies, idle statements, peak RSS, duplicates, PostgreSQL's CPU and
// WAL, millrace's ratios to stock Watermill and to the reference, and
// above them the date, the Go version, the cores, the load average before
// and during the run, and the server's settings.
// A run of one broker leaves the file as it was.
//
// A whole run takes more than go test's default 10-minute timeout: `make
// bench` passes -timeout 60m; `go test -run '^$' -bench BenchmarkRelay
// -timeout 60m ./internal/testing/relaybench` runs it alone, and
// -bench 'BenchmarkRelay/nats' one broker.
//
// The reference (reference_test.go) is the simplest loop that moves the same
// rows with the same payloads and headers to the same broker: a batched
// select on one pgx connection, overlapping the adapter's pipelined
// PublishBatch of the batch before and one DELETE of it on another. It
// keeps none of the relay's guarantees beyond not losing a row, and it
// polls every 5ms when empty, so its idle statements per second are not a
// target. It reads by the xid8 rule too, so it is not measured beside the
// open transaction.
//
// With RELAYBENCH_PROFILE_DIR set, each relay process writes its CPU profile
// and its allocations there (<broker>-<relay>.cpu.pprof, .allocs.pprof).
package relaybench
