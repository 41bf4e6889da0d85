// Package ops is millrace's operations API: what an operator does to an
// installation, over its tables alone, never a broker. The millrace
// command-line tool and the web console (package ops/console) are flags,
// formatting and pages over it; a service or an admin tool calls it from
// Go with the same guarantees.
//
// # Constructing it
//
// New takes the *sql.DB a service already has and its bus.Config; Open
// connects to the config's database.url itself, and Close closes that
// connection. Both check the config (all but the broker section) and that
// the tables exist:
//
//	oc, err := ops.Open(ctx, cfg) // or ops.New(ctx, b.DB(), b.Config())
//	if err != nil { ... }
//	defer oc.Close()
//
// # What it does
//
//   - Outbox: OutboxStatus and OutboxStatuses (pending rows, their age,
//     shards and their owners, lock waits), Throughput (per minute of the
//     last hour).
//   - Dead-letter queue and relay quarantine: DLQ and Quarantine return a
//     Table, one shape for both: List with a Filter, Get, Replay and Purge
//     of a Selection (ids, a Filter or All). Replay and Purge run in one
//     transaction, can be tried with DryRun first, and take the Selection
//     token of that dry run as Expect, so that they act only on what was
//     reviewed (*ChangedError otherwise). PoisonGroups groups the DLQ by
//     failure fingerprint. The DLQ also has Skip: give up on messages for
//     good (state skipped).
//   - Parked aggregates: Parked lists the order keys ordered handlers hold
//     behind a poisoned message (consumer.poison.park), with group, key,
//     count, since and state.
//   - Inbox: PruneInbox, InboxRows.
//   - Scheduled events: ListScheduled, ScheduledEvents, CancelScheduled.
//   - Sagas: ListSagas, Saga.
//
// A replay from the DLQ goes back through the outbox, keeps the event id
// (a consumer group that processed the event already acks it as a
// duplicate), carries the event's own metadata only
// (bus.BrokerConfig.EventMetadata) and reaches only the consumer groups the
// message was poisoned in
// (middleware.ReplayGroupsKey). A poisoned message that holds a parked
// aggregate is the exception: its replay only releases the park in the
// database, and its consumer group hands it to the handler from the parked
// table, ahead of the aggregate's parked messages, with no broker round
// trip; a skip releases the park without it.
//
// # Why a package of its own
//
// Nothing in bus's runtime (publishing, relaying, consuming) uses the
// operations API, and it imports bus for its Config and Publish's rules:
// ops depends on bus, never the other way, as an operator's tools depend
// on the client (river's UI and CLI over its client).
package ops
