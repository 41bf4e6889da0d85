// Package servers starts private, restartable real servers for tests:
// RabbitMQ, NATS with JetStream, PostgreSQL and PgBouncer. Each test gets a
// server process of its own, on its own free ports and in its own data
// directory, so it may stop, restart or crash that server without
// disturbing the shared servers that tests running in parallel use.
//
// Every server is stopped when its test ends and its files are removed
// unless the test failed (then the test log names where they were kept). A
// watchdog process stops the server and removes its files when the test
// binary dies without running its cleanups (a -timeout panic, a kill).
//
// Private NATS servers run a nats-server binary built from the
// github.com/nats-io/nats-server/v2 module at the version go.mod requires
// (the one package natsdev runs in process), not whatever nats-server the
// system has: the first test of a process that needs one builds it with the
// go command, into the user cache directory under a name holding the
// version, where later runs find it. NATS_SERVER_BIN names another binary.
//
// A private PostgreSQL cluster takes more postgresql.conf settings from
// PostgreSQLOptions (StartPostgreSQLWith). StartPrimaryStandby makes a
// primary and a hot standby streaming from it, synchronous or not, for
// failover tests: crash the primary, promote the standby, and reach
// whichever takes writes through a multi-host URL with
// target_session_attrs=read-write; WALPosition and Behind tell how much of
// the primary's write-ahead log the standby has replayed.
//
// StartPgBouncer puts a private PgBouncer (the system's pgbouncer binary,
// Debian's 1.18 where `make up` installed it) in front of a private
// cluster or the shared server, in transaction pooling mode with a few
// server connections per database, so that clients share server sessions
// as they do in production: session state (prepared statements, SET,
// advisory locks) does not follow a client from one transaction to the
// next. pgx's default statement cache fails through it; its
// simple_protocol, exec and cache_describe modes work, describe_exec only
// inside transactions.
//
// PostgreSQL and PgBouncer refuse to run as root: a test running as root
// runs them as the OS user postgres, through runuser.
//
// StartNetns makes a network namespace joined to the host by a veth pair
// whose link Cut and Heal take down and up again; a cluster from
// StartNATSClusterPartitionable or StartRabbitMQClusterPartitionable runs
// one node in one, so that a test can cut that node off the network while
// its process runs on (root and iproute2 needed).
//
// The package is imported from tests only.
package servers
