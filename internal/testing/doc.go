// Package testing is the root of millrace's test support, and holds the
// test that keeps it apart: no runtime package imports anything under
// internal/testing, so a service importing millrace builds none of it.
//
// Its subpackages: testkit (helpers every test shares), testdb (a schema of
// its own per test), testlog, testcerts, servers (private PostgreSQL,
// PgBouncer, RabbitMQ and nats-server processes), brokertest (the brokers a
// test runs against), adaptertest (the contract suite every adapter
// passes), and the two suites that run alone: faults (fault injection,
// docs/RELIABILITY.md) and relaybench (the relay benchmarks).
package testing
