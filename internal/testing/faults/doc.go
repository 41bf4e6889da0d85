// Package faults holds millrace's fault-injection suite: each scenario runs
// the whole path (a service committing events in business transactions ->
// outbox -> relay -> broker -> consumer -> inbox and a business effect) on
// every broker, with the relay and the consumers as separate processes it
// can SIGKILL or SIGTERM, and servers of its own it can restart. After each
// scenario it checks that every committed event had exactly one effect,
// that no rolled-back event had any, and that each aggregate's effects ran
// in version order where millrace promises it.
//
// The cluster scenarios run private 3-node clusters (internal/testing/servers) and
// hit the node that leads the topic's stream or queue. The partition
// scenarios (NATS and RabbitMQ) cut that node off the network instead of
// stopping it: the node runs in a network namespace of its own joined by a
// veth pair whose link is taken down, which needs root and iproute2 (`ip
// netns`).
//
// The PostgreSQL scenarios run the flow beside a session left idle in
// transaction, beside another service on the same server (a second world)
// whose broker is frozen, through a private PgBouncer in transaction mode,
// and across a crash of a private primary and the promotion of its
// standby, synchronous or asynchronous. The asynchronous one counts what
// the WAL the standby never received took with it, and requires that
// nothing else is lost.
//
// Every scenario reports the commit-to-effect latency: the time from the
// service's COMMIT to the insert of its event's effect.
//
// `make test` runs it at 100 events/s with the relay outage at 1 minute.
// `make reliability` runs it at 200 events/s with the 5-minute outage and
// rewrites docs/RELIABILITY.md from the results.
package faults
