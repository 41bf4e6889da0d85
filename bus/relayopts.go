package bus

import (
	"database/sql"

	"github.com/millrace-io/millrace/forwarder"
)

// relayOptions are the relay's collaborators: the Bus's logger, metrics
// and tracing, the direct pool it LISTENs on, and the URL of its
// replication connection with relay.source: wal (database.direct_url,
// else database.url: a pooler cannot carry replication).
func (b *Bus) relayOptions(direct *sql.DB) forwarder.Options {
	return forwarder.Options{Logger: b.logger, Registerer: b.registerer,
		TracerProvider: b.tracerProvider, Propagator: b.propagator, Direct: direct,
		ReplicationURL: b.cfg.WALSlot().URL}
}
