package wal

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Errors of the requirements and the slot; the errors returned wrap them
// and say what to do.
var (
	// ErrWALLevel: the server's wal_level is not logical.
	ErrWALLevel = errors.New("wal_level is not logical")
	// ErrNoReplicationPrivilege: the role may not open a replication
	// connection.
	ErrNoReplicationPrivilege = errors.New("role lacks the REPLICATION privilege")
	// ErrNoSenders: max_replication_slots or max_wal_senders is zero.
	ErrNoSenders = errors.New("replication slots or WAL senders are disabled")
	// ErrSlotLost: PostgreSQL invalidated the slot; it cannot be read again.
	ErrSlotLost = errors.New("replication slot invalidated")
	// ErrNoSlot: the slot does not exist.
	ErrNoSlot = errors.New("replication slot does not exist")
	// ErrSlotExists: CreateSlot found the slot there already.
	ErrSlotExists = errors.New("replication slot exists already")
	// ErrSlotActive: another connection reads the slot. That is another
	// reader, or the WAL sender of a reader that died (SIGKILLed), which
	// holds the slot until PostgreSQL notices that its client is gone:
	// milliseconds on an idle server, longer on a loaded one.
	ErrSlotActive = errors.New("replication slot is read by another connection")
	// ErrPublication: the publication is missing and the role may not
	// create it, or it does not publish the outbox table.
	ErrPublication = errors.New("the publication of the outbox is missing or incomplete")
)

// requirements is what Check reads from the server.
type requirements struct {
	walLevel, role     string
	replication        bool
	slots, senders     int
	walSenderTimeoutMS int64
}

// Check tells whether the server and role at url can run the WAL relay,
// with an error naming the setting or the statement that fixes what is
// missing (wrapping ErrWALLevel, ErrNoReplicationPrivilege or
// ErrNoSenders). It reads settings only, on an ordinary connection.
func Check(ctx context.Context, url string) error {
	conn, err := pgconn.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("wal: connect: %w", err)
	}
	defer closeConn(conn)
	_, err = check(ctx, conn)
	return err
}

// check reads the requirements on conn and reports the first one missing.
func check(ctx context.Context, conn *pgconn.PgConn) (requirements, error) {
	var r requirements
	row, err := queryRow(ctx, conn, `SELECT current_setting('wal_level'), current_user,
		coalesce((SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user), false),
		current_setting('max_replication_slots'), current_setting('max_wal_senders'),
		(SELECT setting FROM pg_settings WHERE name = 'wal_sender_timeout')`)
	if err != nil {
		return r, fmt.Errorf("wal: read the replication settings: %w", err)
	}
	r.walLevel, r.role, r.replication = string(row[0]), string(row[1]), string(row[2]) == "t"
	r.slots, _ = strconv.Atoi(string(row[3]))
	r.senders, _ = strconv.Atoi(string(row[4]))
	r.walSenderTimeoutMS, _ = strconv.ParseInt(string(row[5]), 10, 64)
	switch {
	case r.walLevel != "logical":
		return r, fmt.Errorf("wal: %w: the server runs with wal_level = %s; the WAL relay needs wal_level = logical: "+
			"run ALTER SYSTEM SET wal_level = logical (or set it in postgresql.conf) and restart PostgreSQL, "+
			"wal_level only changes at server start", ErrWALLevel, r.walLevel)
	case !r.replication:
		return r, fmt.Errorf("wal: %w: role %q may not open a replication connection; as a superuser run "+
			"ALTER ROLE %s REPLICATION", ErrNoReplicationPrivilege, r.role, quoteIdent(r.role))
	case r.slots == 0 || r.senders == 0:
		return r, fmt.Errorf("wal: %w: max_replication_slots = %d and max_wal_senders = %d; set both above zero "+
			"(ALTER SYSTEM SET ...) and restart PostgreSQL", ErrNoSenders, r.slots, r.senders)
	}
	return r, nil
}

// statusInterval is configured lowered to half of the server's
// wal_sender_timeout, so that the server never times the Reader out.
func (r requirements) statusInterval(configured time.Duration) time.Duration {
	if half := time.Duration(r.walSenderTimeoutMS) * time.Millisecond / 2; half > 0 && half < configured {
		return half
	}
	return configured
}
