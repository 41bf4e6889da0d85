// Package embed is the seam between the NATS adapter and its in-process
// server: package natsdev registers its starter here when a program imports
// it, and the adapter starts the server broker.nats.embedded asks for
// through it, so a program that does not import natsdev links no
// nats-server.
package embed
