// Package console is millrace's web console: server-rendered pages over
// bus.Ops for the outbox (status per relay group), the dead-letter queue
// (filters, failure groups by fingerprint, one message's envelope,
// metadata, payload and replay history) and the relay quarantine, with
// replay and purge of a selection or a whole group, each shown as a dry
// run with its count before an explicit confirmation; and, read-only, saga
// instances (state and pending timeouts with their due times) and
// scheduled events. It runs no SQL of its own.
//
// New returns an http.Handler a service mounts behind its own
// authentication (it works under any path prefix with http.StripPrefix);
// `millrace ui` serves it on 127.0.0.1.
//
// Safe by default: every action (a POST) needs the CSRF token of the
// visitor's session and passes http.CrossOriginProtection; Options.Token or
// Options.BasicUser/BasicPassword make every page require them;
// Options.ReadOnly refuses every action. No secret of the configuration
// (URLs, passwords, the console's token) is ever rendered. Pages set a
// strict Content-Security-Policy; the little JavaScript (select all) comes
// from the handler itself, and every page works without it.
//
// It lives in a package of its own because it renders bus's types (bus
// cannot import it back), and so that a service that does not mount it
// does not link its templates.
package console
