// Package natsdev is the in-process NATS JetStream server for development,
// tests and demos; production programs do not import it.
//
// Start runs a nats-server with JetStream and file storage inside the
// process. Importing the package (import _ ".../adapters/nats/natsdev")
// also lets broker.nats.embedded.enabled: true start one from config, as
// importing a database/sql driver registers it; a program that does not
// import it links no nats-server, and a config that asks for the embedded
// server there is an error naming broker.nats.embedded.enabled.
package natsdev
