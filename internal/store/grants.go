package store

import (
	"fmt"
	"strings"

	"github.com/millrace-io/millrace/internal/names"
)

// Grant is one privilege the role a service runs as needs at run time on
// one of millrace's objects, and which part of millrace uses it. Migrate
// runs as the objects' owner; the service role gets exactly these.
type Grant struct {
	// Privilege is USAGE, SELECT, INSERT, UPDATE or DELETE.
	Privilege string
	// Kind is SCHEMA, TABLE or SEQUENCE.
	Kind string
	// Object is the object's qualified, quoted name.
	Object string
	// Name is the object's bare name, as PostgreSQL's "permission denied
	// for table <name>" says it (for a sequence whose name PostgreSQL
	// shortened, the name it would have had).
	Name string
	// Use says what needs it.
	Use string
	// Sharding is true for a privilege only a relay with relay.shards > 1
	// uses, or one that changes relay.shards.
	Sharding bool

	// serialOf is the qualified table whose serial column's sequence this
	// is, when PostgreSQL had to shorten the sequence's name: GrantSQL
	// looks it up instead of naming it.
	serialOf string
}

// serialSequence is the name PostgreSQL gives the sequence of a serial
// column when it fits in an identifier (table_column_seq).
func serialSequence(table, column string) (string, bool) {
	name := table + "_" + column + "_seq"
	return name, len(name) <= MaxIdentifierLength
}

// Grants lists every privilege a service role needs on t's objects, one
// per privilege and object: publishing (bus.Publish), the relay, and
// consumers (inbox, ordering guard, poison table). A service that only
// publishes, or a relay running as its own process, needs only its part.
func Grants(t Tables) []Grant {
	table := func(name string) (string, string) { return t.qualify(name), name }
	var g []Grant
	add := func(privs, kind, object, name, use string) {
		for _, p := range strings.Split(privs, ",") {
			g = append(g, Grant{Privilege: strings.TrimSpace(p), Kind: kind, Object: object, Name: name, Use: use})
		}
	}
	add("USAGE", "SCHEMA", `"`+t.Schema+`"`, t.Schema, "every part: look up millrace's tables")

	outbox, outboxName := table("watermill_" + t.OutboxTopic)
	add("INSERT", "TABLE", outbox, outboxName, "publish: write events into the outbox")
	seq, fits := serialSequence(outboxName, "offset")
	add("USAGE", "SEQUENCE", t.qualify(seq), seq, `publish: number outbox rows (the "offset" column)`)
	if !fits {
		g[len(g)-1].serialOf = outbox
	}
	add("SELECT", "TABLE", outbox, outboxName, "relay: read pending events; outbox status")
	add("DELETE", "TABLE", outbox, outboxName, "relay: delete forwarded rows after relay.retention")

	cursors, cursorsName := table("millrace_relay_cursors")
	add("SELECT, INSERT, UPDATE", "TABLE", cursors, cursorsName, "relay: its position in the outbox and the lease of the active relay")
	brokers, brokersName := table("millrace_outbox_brokers")
	add("SELECT", "TABLE", brokers, brokersName, "every part: the broker.kind the outbox is relayed to, checked at Open")
	add("INSERT, UPDATE", "TABLE", brokers, brokersName, "relay: record its broker.kind once the outbox is drained")
	offsets, offsetsName := table("watermill_offsets_" + t.OutboxTopic)
	add("SELECT", "TABLE", offsets, offsetsName, "relay: start a new cursor where a relay of an earlier version left off")

	shards, shardsName := table("millrace_relay_shards")
	add("SELECT", "TABLE", shards, shardsName, "publish: the outbox trigger reads the shard count")
	sharding := len(g)
	add("INSERT, UPDATE", "TABLE", shards, shardsName, "relay: record a new relay.shards once the outbox is drained")
	instances, instancesName := table("millrace_relay_instances")
	add("SELECT, INSERT, UPDATE, DELETE", "TABLE", instances, instancesName, "relay with relay.shards > 1: register, heartbeat, drop dead instances")
	for i := sharding; i < len(g); i++ {
		g[i].Sharding = true
	}

	quarantine, quarantineName := table("millrace_relay_quarantine")
	add("SELECT, INSERT", "TABLE", quarantine, quarantineName, "relay: set aside rows no broker can take; outbox status counts them")
	add("USAGE", "SEQUENCE", t.qualify("millrace_relay_quarantine_id_seq"), "millrace_relay_quarantine_id_seq", "relay: number quarantined rows")

	inbox, inboxName := table("millrace_inbox")
	add("SELECT, INSERT, UPDATE, DELETE", "TABLE", inbox, inboxName,
		"consumers: record processed events; inbox retention deletes old rows (locking them, hence UPDATE)")

	versions, versionsName := table("millrace_aggregate_versions")
	add("SELECT, INSERT, UPDATE", "TABLE", versions, versionsName, "consumers with consumer.ordering_guard: the latest version applied")

	poison, poisonName := table("millrace_poison")
	add("SELECT, INSERT, UPDATE", "TABLE", poison, poisonName, "consumers: store poisoned messages (again: update their row)")
	add("USAGE", "SEQUENCE", t.qualify("millrace_poison_id_seq"), "millrace_poison_id_seq", "consumers: number poisoned messages")

	parks, parksName := table("millrace_parks")
	add("SELECT, INSERT, UPDATE, DELETE", "TABLE", parks, parksName,
		"ordered consumers with consumer.poison.park: park an aggregate behind its poisoned message, drain it once released")
	parked, parkedName := table("millrace_parked")
	add("SELECT, INSERT, UPDATE, DELETE", "TABLE", parked, parkedName,
		"ordered consumers with consumer.poison.park: hold a parked aggregate's messages, hand them on once released")
	add("USAGE", "SEQUENCE", t.qualify("millrace_parked_id_seq"), "millrace_parked_id_seq", "ordered consumers with consumer.poison.park: number parked messages")
	add("USAGE", "SEQUENCE", t.qualify("millrace_parked_pos"), "millrace_parked_pos", "ordered consumers with consumer.poison.park: order parked messages")

	scheduled, scheduledName := table("millrace_scheduled")
	add("INSERT", "TABLE", scheduled, scheduledName, "publish: schedule events for later")
	add("USAGE", "SEQUENCE", t.qualify("millrace_scheduled_seq_seq"), "millrace_scheduled_seq_seq", "publish: order scheduled events due at the same time")
	add("SELECT, UPDATE, DELETE", "TABLE", scheduled, scheduledName,
		"relay: move due events into the outbox (locking them, hence UPDATE); cancel a scheduled event; list them")

	sagas, sagasName := table("millrace_sagas")
	add("SELECT, INSERT, UPDATE, DELETE", "TABLE", sagas, sagasName,
		"consumers with sagas: load and save saga state; delete completed sagas after their retention (locking them, hence UPDATE)")
	sagaErrors, sagaErrorsName := table("millrace_saga_errors")
	add("SELECT, INSERT, UPDATE, DELETE", "TABLE", sagaErrors, sagaErrorsName,
		"consumers with sagas: record a step's last error; delete old ones after the saga's retention")
	return g
}

// ReplicationUse says what needs the REPLICATION attribute: the relay with
// relay.source: wal.
const ReplicationUse = "relay with relay.source: wal: stream the outbox from its replication slot (run as a superuser)"

// ReplicationSQL is the statement that gives role the REPLICATION
// attribute, with a comment saying what needs it; role must be an
// identifier GrantSQL accepts.
func ReplicationSQL(role string) string {
	return fmt.Sprintf("-- %s\nALTER ROLE \"%s\" REPLICATION;\n", ReplicationUse, role)
}

// GrantSQL returns the GRANT statements that give role every privilege of
// Grants(t): one statement per object, each with a comment saying what
// needs it. Run them as the owner of the tables (whoever ran Migrate).
func GrantSQL(t Tables, role string) (string, error) {
	if err := t.Validate(); err != nil {
		return "", err
	}
	if err := names.Identifier(role, MaxIdentifierLength); err != nil {
		return "", fmt.Errorf("role %q: %w", role, err)
	}
	var b strings.Builder
	grants := Grants(t)
	for i := 0; i < len(grants); {
		// One statement per object and use: consecutive grants on it merge.
		j := i
		var privs []string
		for j < len(grants) && grants[j].Object == grants[i].Object && grants[j].Use == grants[i].Use {
			privs = append(privs, grants[j].Privilege)
			j++
		}
		g := grants[i]
		if g.serialOf != "" {
			// PostgreSQL shortened the sequence's name: look it up.
			fmt.Fprintf(&b, "-- %s\nDO $$ BEGIN EXECUTE format('GRANT %s ON SEQUENCE %%s TO %%I', pg_get_serial_sequence('%s', 'offset'), '%s'); END $$;\n",
				g.Use, g.Privilege, g.serialOf, role)
		} else {
			fmt.Fprintf(&b, "-- %s\nGRANT %s ON %s %s TO \"%s\";\n", g.Use, strings.Join(privs, ", "), g.Kind, g.Object, role)
		}
		i = j
	}
	return b.String(), nil
}
