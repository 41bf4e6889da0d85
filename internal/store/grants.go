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
	var g []Grant
	add := func(privs, kind, object, name, use string) {
		for _, p := range strings.Split(privs, ",") {
			g = append(g, Grant{Privilege: strings.TrimSpace(p), Kind: kind, Object: object, Name: name, Use: use})
		}
	}
	onTable := func(privs, name, use string) { add(privs, "TABLE", t.qualify(name), name, use) }
	onSequence := func(name, use string) { add("USAGE", "SEQUENCE", t.qualify(name), name, use) }
	add("USAGE", "SCHEMA", `"`+t.Schema+`"`, t.Schema, "every part: look up millrace's tables")

	outboxName := "watermill_" + t.OutboxTopic
	onTable("INSERT", outboxName, "publish: write events into the outbox")
	seq, fits := serialSequence(outboxName, "offset")
	onSequence(seq, `publish: number outbox rows (the "offset" column)`)
	if !fits {
		g[len(g)-1].serialOf = t.qualify(outboxName)
	}
	onTable("SELECT", outboxName, "relay: read pending events; outbox status")
	onTable("DELETE", outboxName, "relay: delete forwarded rows after relay.retention")

	onTable("SELECT, INSERT, UPDATE", "millrace_relay_cursors", "relay: its position in the outbox and the lease of the active relay")
	onTable("SELECT", "millrace_outbox_brokers", "every part: the broker.kind the outbox is relayed to, checked at Open")
	onTable("INSERT, UPDATE", "millrace_outbox_brokers", "relay: record its broker.kind once the outbox is drained")
	onTable("SELECT", "watermill_offsets_"+t.OutboxTopic, "relay: start a new cursor where a relay of an earlier version left off")

	onTable("SELECT", "millrace_relay_shards", "publish: the outbox trigger reads the shard count")
	sharding := len(g)
	onTable("INSERT, UPDATE", "millrace_relay_shards", "relay: record a new relay.shards once the outbox is drained")
	onTable("SELECT, INSERT, UPDATE, DELETE", "millrace_relay_instances", "relay with relay.shards > 1: register, heartbeat, drop dead instances")
	for i := sharding; i < len(g); i++ {
		g[i].Sharding = true
	}

	onTable("SELECT, INSERT", "millrace_relay_quarantine", "relay: set aside rows no broker can take; outbox status counts them")
	onSequence("millrace_relay_quarantine_id_seq", "relay: number quarantined rows")

	onTable("SELECT, INSERT, UPDATE, DELETE", "millrace_inbox",
		"consumers: record processed events; inbox retention deletes old rows (locking them, hence UPDATE)")

	onTable("SELECT, INSERT, UPDATE", "millrace_aggregate_versions", "consumers with consumer.ordering_guard: the latest version applied")

	onTable("SELECT, INSERT, UPDATE", "millrace_poison", "consumers: store poisoned messages (again: update their row)")
	onSequence("millrace_poison_id_seq", "consumers: number poisoned messages")

	onTable("SELECT, INSERT, UPDATE, DELETE", "millrace_parks",
		"ordered consumers with consumer.poison.park: park an aggregate behind its poisoned message, drain it once released")
	onTable("SELECT, INSERT, UPDATE, DELETE", "millrace_parked",
		"ordered consumers with consumer.poison.park: hold a parked aggregate's messages, hand them on once released")
	onSequence("millrace_parked_id_seq", "ordered consumers with consumer.poison.park: number parked messages")
	onSequence("millrace_parked_pos", "ordered consumers with consumer.poison.park: order parked messages")

	onTable("INSERT", "millrace_scheduled", "publish: schedule events for later")
	onSequence("millrace_scheduled_seq_seq", "publish: order scheduled events due at the same time")
	onTable("SELECT, UPDATE, DELETE", "millrace_scheduled",
		"relay: move due events into the outbox (locking them, hence UPDATE); cancel a scheduled event; list them")

	onTable("SELECT, INSERT, UPDATE, DELETE", "millrace_sagas",
		"consumers with sagas: load and save saga state; delete completed sagas after their retention (locking them, hence UPDATE)")
	onTable("SELECT, INSERT, UPDATE, DELETE", "millrace_saga_errors",
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
