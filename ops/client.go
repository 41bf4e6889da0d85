package ops

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/store"
)

// Client is the operations API of one millrace installation: outbox status,
// the dead-letter queue (the poison table, DLQ) and the relay quarantine
// (Quarantine) with list, show, replay and purge, inbox pruning, scheduled
// events (list, cancel) and saga instances (list, show). It needs only the
// database, never a broker. The millrace command-line tool and the web
// console are thin layers over it; a service or an admin tool can call it
// from Go. It is safe for concurrent use.
//
// Replays keep every guarantee of the command-line tool's: they go back
// through the outbox in one transaction, keep the event id (so a consumer
// group that processed the event already acks it as a duplicate), reach
// only the consumer groups the message was poisoned in, and can be tried
// with DryRun first.
type Client struct {
	db     *sql.DB
	cfg    bus.Config
	tables store.Tables
	// owned is true when Open opened db: Close closes it.
	owned bool
}

// New returns the operations API over cfg's tables in db. It applies
// cfg's defaults, validates it (all but the broker section, which the
// Client never connects to) and checks that the tables exist (a database
// that is down or not migrated is a clear error here, not later). The
// caller keeps db: Close leaves it open.
func New(ctx context.Context, db *sql.DB, cfg bus.Config) (*Client, error) {
	if err := cfg.ValidateDatabase(); err != nil {
		return nil, err
	}
	if db == nil {
		return nil, errors.New("millrace: ops.New needs a database")
	}
	return newClient(ctx, db, cfg.WithDefaults())
}

// Open checks cfg as New does, connects to its database.url (bus.OpenDB)
// and returns the operations API over that connection, which Close
// closes.
func Open(ctx context.Context, cfg bus.Config) (*Client, error) {
	if err := cfg.ValidateDatabase(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		return nil, err
	}
	c, err := newClient(ctx, db, cfg)
	if err != nil {
		db.Close()
		return nil, err
	}
	c.owned = true
	return c, nil
}

// newClient returns the Client over db and cfg (checked, defaults
// applied) once it found every table.
func newClient(ctx context.Context, db *sql.DB, cfg bus.Config) (*Client, error) {
	c := &Client{db: db, cfg: cfg, tables: store.Tables{Schema: cfg.Database.Schema, OutboxTopic: cfg.Outbox.Topic}}
	cctx, cancel := context.WithTimeout(ctx, cfg.Database.ConnectTimeout)
	defer cancel()
	t := c.tables
	missing, err := store.Missing(cctx, db, t.OutboxTable(), t.OffsetsTable(), t.QuarantineTable(), t.InboxTable(),
		t.PoisonTable(), t.PoisonReplaysTable(), t.AggregateVersionsTable(), t.ScheduledTable(), t.SagasTable(), t.SagaErrorsTable())
	if err != nil {
		return nil, fmt.Errorf("millrace: database %s not reachable within database.connect_timeout (%s): %w",
			confload.RedactURL(cfg.Database.URL), cfg.Database.ConnectTimeout, err)
	}
	if missing != "" {
		return nil, fmt.Errorf("millrace: table %s does not exist: run `millrace migrate` or bus.Migrate first", missing)
	}
	return c, nil
}

// Close closes the database connection Open opened; after New it does
// nothing (the caller keeps its *sql.DB).
func (c *Client) Close() error {
	if !c.owned {
		return nil
	}
	return c.db.Close()
}

// Config returns the configuration the Client runs with, defaults applied.
func (c *Client) Config() bus.Config { return c.cfg }

// ErrNotFound is matched (errors.Is) by the *NotFoundError of an operation
// given ids that do not exist.
var ErrNotFound = errors.New("millrace: not found")

// NotFoundError names the ids an operation did not find; the operation
// changed nothing.
type NotFoundError struct {
	// What is "poisoned message" or "quarantined row".
	What string
	// IDs are the ids that do not exist.
	IDs []int64
}

// Error names the ids not found.
func (e *NotFoundError) Error() string {
	s := make([]string, len(e.IDs))
	for i, id := range e.IDs {
		s[i] = strconv.FormatInt(id, 10)
	}
	if len(s) == 1 {
		return fmt.Sprintf("no %s with id %s", e.What, s[0])
	}
	return fmt.Sprintf("no %ss with ids %s", e.What, strings.Join(s, ", "))
}

// Is matches ErrNotFound.
func (e *NotFoundError) Is(target error) bool { return target == ErrNotFound }

// missingIDs returns a *NotFoundError for the ids that found lacks, or nil.
func missingIDs(what string, ids []int64, found map[int64]bool) error {
	var missing []int64
	for _, id := range ids {
		if !found[id] {
			missing = append(missing, id)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	return &NotFoundError{What: what, IDs: missing}
}

// page converts rows read with a limit of limit+1 and says whether more
// matched than limit (0: no limit).
func page[R, T any](rows []R, convert func(R) T, limit int) (out []T, truncated bool) {
	out = make([]T, 0, len(rows))
	for _, r := range rows {
		out = append(out, convert(r))
	}
	if limit > 0 && len(out) > limit {
		return out[:limit], true
	}
	return out, false
}

// listLimit is the limit to read for a page of limit rows: one more, to
// tell whether more match.
func listLimit(limit int) (int, error) {
	switch {
	case limit < 0:
		return 0, fmt.Errorf("millrace: the limit must not be negative; got %d", limit)
	case limit == 0:
		return 0, nil
	}
	return limit + 1, nil
}

// inTx runs f in a transaction and commits it unless dryRun (then it rolls
// back: a dry run changes nothing).
func (c *Client) inTx(ctx context.Context, dryRun bool, what string, f func(tx *sql.Tx) error) error {
	tx, err := c.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("millrace: begin transaction: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	if err := f(tx); err != nil || dryRun {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("millrace: commit %s: %w", what, err)
	}
	return nil
}
