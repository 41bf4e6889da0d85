// Package relaybench measures millrace's relay against Watermill's stock
// forwarder on every broker, in one run: `make bench` runs BenchmarkRelay.
//
// Each relay runs in a child process (the test binary re-executed) so its
// peak RSS and its SQL statements are its own. For each broker and relay the
// benchmark commits a backlog of 50,000 events, starts the relay and times
// the drain (until nothing is pending), counts the relay's SQL statements
// per second while idle, then commits a trickle of 200 events/s and measures
// commit-to-consumer latency. The results print as one table with ratios.
package relaybench
