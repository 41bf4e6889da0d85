// Package console is millrace's web console: server-rendered pages over
// the operations API (package ops) for the outbox (status per relay group), the dead-letter queue
// (filters, failure groups by fingerprint, one message's envelope,
// metadata, payload and replay history) and the relay quarantine, with
// replay and purge of a selection or a whole group, each shown as a dry
// run with its count before an explicit confirmation; and, read-only, saga
// instances (state and pending timeouts with their due times) and
// scheduled events. It runs no SQL of its own.
//
// The overview charts the last hour per minute, as inline SVG drawn on the
// server (no script), each with a description giving its numbers: per relay
// group, the events forwarded (the outbox rows its cursor has passed, in
// the minute they were written: the database keeps no time of forwarding,
// and rows deleted after relay.retention are missing) and the oldest
// pending age; per consumer group, the events processed (inbox rows by
// processed_at) and the lag (millrace_consumer_backlog, with
// Options.Metrics). The counts come from the database (ops.Client.Throughput);
// the ages and lags, of which it keeps no history, the console samples
// itself every Options.SampleInterval into a ring of the last hour, in
// memory, so that they cover only the time since it started.
//
// New returns a *Console, an http.Handler a service mounts behind its own
// authentication (it works under any path prefix with http.StripPrefix);
// Close stops its sampling goroutine. `millrace ui` serves it on 127.0.0.1.
//
// Safe by default: every action (a POST) needs the CSRF token of the
// visitor's session and passes http.CrossOriginProtection; Options.Token or
// Options.BasicUser/BasicPassword make every page require them;
// Options.ReadOnly refuses every action. No secret of the configuration
// (URLs, passwords, the console's token) is ever rendered. Pages set a
// strict Content-Security-Policy; the little JavaScript (select all) comes
// from the handler itself, and every page works without it.
//
// It lives under ops, in a package of its own, because it is a view of the
// operations API and of nothing else (it imports ops, never bus's runtime),
// and so that a service that does not mount it does not link its
// templates.
package console
