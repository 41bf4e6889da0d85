// Package relaybench measures millrace's relay against Watermill's stock
// forwarder and against a hand-written reference relay, the ceiling, on
// every broker, in one run: `make bench` runs BenchmarkRelay.
//
// Each relay runs in a child process (the test binary re-executed) so its
// peak RSS and its SQL statements are its own. For each broker and relay the
// benchmark commits a backlog of 50,000 events, starts the relay and times
// the drain (until no shard has a row past its position, probed on the
// primary key; then `millrace outbox status` must say 0 pending) while a
// consumer receives, counts the relay's SQL statements per second while
// idle, then commits a trickle of 200 events/s for 5s and one of 2,000
// events/s for 3s, one event per transaction from several writers on one
// schedule, and measures commit-to-consumer latency at each. The results
// print as one table per broker: drain, percent of the reference's, p50 and
// p99 at each rate, idle statements/s, peak RSS, and millrace's ratios to
// stock Watermill; a trickle the writers could not keep up is noted with the
// rate reached. The RabbitMQ consumer prefetches 500 so that it keeps up. millrace-3x8 is millrace as three
// relay processes on relay.shards: 8 (its idle statements and peak RSS are
// the three processes' sums), beside the single millrace relay.
//
// The reference (reference_test.go) is the simplest loop that moves the same
// rows with the same payloads and headers to the same broker: a batched
// select on one pgx connection, overlapping the adapter's pipelined
// PublishBatch of the batch before and one DELETE of it on another. It keeps none of the relay's guarantees
// beyond not losing a row, and it polls every 5ms when empty, so its idle
// statements per second are not a target.
//
// With RELAYBENCH_PROFILE_DIR set, each relay process writes its CPU profile
// and its allocations there (<broker>-<relay>.cpu.pprof, .allocs.pprof).
package relaybench
