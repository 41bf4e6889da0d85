package bus

import (
	"cmp"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/store"
)

// Ops is the operations API of one millrace installation: outbox status,
// the dead-letter queue (the poison table) and the relay quarantine with
// list, show, replay and purge, inbox pruning, scheduled events (list,
// cancel) and saga instances (list, show). It needs only the
// database, never a broker. The millrace command-line tool and the web
// console are thin layers over it; a service or an admin tool can call it
// from Go. It is safe for concurrent use.
//
// Replays keep every guarantee of the command-line tool's: they go back
// through the outbox in one transaction, keep the event id (so a consumer
// group that processed the event already acks it as a duplicate), reach
// only the consumer groups the message was poisoned in, and can be tried
// with DryRun first.
type Ops struct {
	db     *sql.DB
	cfg    Config
	tables store.Tables
}

// NewOps returns the operations API over cfg's tables in db. It applies
// cfg's defaults, validates it (all but the broker section, which Ops never
// connects to) and checks that the tables exist (a database that is down
// or not migrated is a clear error here, not later).
func NewOps(ctx context.Context, db *sql.DB, cfg Config) (*Ops, error) {
	cfg, err := cfg.checkFor(false)
	if err != nil {
		return nil, err
	}
	if db == nil {
		return nil, errors.New("millrace: NewOps needs a database")
	}
	o := &Ops{db: db, cfg: cfg, tables: tablesOf(cfg)}
	cctx, cancel := context.WithTimeout(ctx, cfg.Database.ConnectTimeout)
	defer cancel()
	t := o.tables
	missing, err := store.Missing(cctx, db, t.OutboxTable(), t.OffsetsTable(), t.QuarantineTable(), t.InboxTable(),
		t.PoisonTable(), t.PoisonReplaysTable(), t.AggregateVersionsTable(), t.ScheduledTable(), t.SagasTable(), t.SagaErrorsTable())
	if err != nil {
		return nil, fmt.Errorf("millrace: database %s not reachable within database.connect_timeout (%s): %w",
			redactURL(cfg.Database.URL), cfg.Database.ConnectTimeout, err)
	}
	if missing != "" {
		return nil, fmt.Errorf("millrace: table %s does not exist: run `millrace migrate` or bus.Migrate first", missing)
	}
	return o, nil
}

// Config returns the configuration Ops runs with, defaults applied.
func (o *Ops) Config() Config { return o.cfg }

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
func (o *Ops) inTx(ctx context.Context, dryRun bool, what string, f func(tx *sql.Tx) error) error {
	tx, err := o.db.BeginTx(ctx, nil)
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

// ErrInvalidSelection is matched by the error of a replay or purge given
// no selection, or several kinds of it at once.
var ErrInvalidSelection = errors.New("millrace: invalid selection")

// ErrInvalidFilter is matched by the error of a list, replay or purge
// given a filter field that can never match (a malformed fingerprint).
var ErrInvalidFilter = errors.New("millrace: invalid filter")

// ErrChanged is matched (errors.Is) by the *ChangedError of an action whose
// selection changed since it was reviewed.
var ErrChanged = errors.New("millrace: the selection changed")

// ChangedError reports that a replay or purge with an Expect token found
// its selection changed (messages replayed, purged, poisoned again or
// processed, or new ones matching): it changed nothing.
type ChangedError struct {
	// What is "poisoned message" or "quarantined row".
	What string
	// Rows counts what the selection holds now.
	Rows int
	// Selection is the token of the selection as it is now.
	Selection string
}

func (e *ChangedError) Error() string {
	return fmt.Sprintf("the selected %ss changed since they were reviewed (replayed, purged or poisoned again; %d match now): nothing was done; review the selection again",
		e.What, e.Rows)
}

// Is matches ErrChanged.
func (e *ChangedError) Is(target error) bool { return target == ErrChanged }

// checkSelection returns the token of rows (their versions, in id order)
// and a *ChangedError when expect is set and differs from it.
func checkSelection[R any](what string, rows []R, version func(R) string, expect string) (string, error) {
	versions := make([]string, len(rows))
	for i, r := range rows {
		versions[i] = version(r)
	}
	slices.Sort(versions)
	sum := sha256.Sum256([]byte(strings.Join(versions, ";")))
	token := hex.EncodeToString(sum[:8])
	if expect != "" && expect != token {
		return token, &ChangedError{What: what, Rows: len(rows), Selection: token}
	}
	return token, nil
}

// selectionError checks that exactly one of ids, a filter or all was given,
// and that limit goes with a filter or all.
func selectionError(ids []int64, filtered, all bool, limit int) error {
	kinds := 0
	for _, given := range []bool{len(ids) > 0, filtered, all} {
		if given {
			kinds++
		}
	}
	switch {
	case kinds == 0:
		return fmt.Errorf("%w: choose ids, a filter or all", ErrInvalidSelection)
	case kinds > 1:
		return fmt.Errorf("%w: give ids, a filter or all, not several of them", ErrInvalidSelection)
	case len(ids) > 0 && limit > 0:
		return fmt.Errorf("%w: a limit applies to a filter or all, not to ids", ErrInvalidSelection)
	case limit < 0:
		return fmt.Errorf("%w: the limit must not be negative; got %d", ErrInvalidSelection, limit)
	}
	for _, id := range ids {
		if id <= 0 {
			return fmt.Errorf("%w: ids are positive integers; got %d", ErrInvalidSelection, id)
		}
	}
	return nil
}

// TimeBound is one end of a time range in a filter: an instant (At) or a
// duration before now on the database's clock (Ago). The zero TimeBound
// leaves that end open.
type TimeBound struct{ b store.TimeBound }

// At is the bound at the instant t.
func At(t time.Time) TimeBound { return TimeBound{store.TimeBound{At: t, Set: true}} }

// Ago is the bound d before the database's now.
func Ago(d time.Duration) TimeBound { return TimeBound{store.TimeBound{Ago: d, Set: true}} }

// IsZero reports whether the bound is open.
func (b TimeBound) IsZero() bool { return !b.b.Set }

func (b TimeBound) String() string {
	switch {
	case !b.b.Set:
		return ""
	case !b.b.At.IsZero():
		return b.b.At.Format(time.RFC3339Nano)
	default:
		return b.b.Ago.String() + " ago"
	}
}

// OutboxStatus is the state of the outbox as one relay consumer group sees it.
type OutboxStatus struct {
	// RelayGroup is the relay consumer group (relay.consumer_group).
	RelayGroup string `json:"relay_group"`
	// Pending counts committed rows not forwarded yet.
	Pending int64 `json:"pending"`
	// OldestPendingAge is the age of the oldest pending row.
	OldestPendingAge time.Duration `json:"oldest_pending_age_ns"`
	// LastForwardedAt is when the last forwarded row was written, if it is
	// still in the table; zero otherwise.
	LastForwardedAt time.Time `json:"last_forwarded_at,omitzero"`
	// Forwarded counts forwarded rows still in the table (kept for relay.retention).
	Forwarded int64 `json:"forwarded_retained"`
	// Quarantined counts rows in the relay quarantine.
	Quarantined int64 `json:"quarantined"`
	// Shards is the number of shards the outbox is split into (relay.shards,
	// as the outbox recorded it).
	Shards int `json:"shards"`
	// ShardStates lists each shard's owner and backlog when Shards > 1.
	ShardStates []ShardState `json:"shard_states,omitempty"`
	// Broker is the broker.kind the outbox is relayed to, as its relays
	// recorded it; "" before a relay of this version ran.
	Broker string `json:"broker,omitempty"`
	// Waits lists the transactions whose locks statements of the outbox's
	// relays have waited for a second or longer, longest first: the relay
	// waits for no transaction's commit, only for locks (an operator's
	// SELECT FOR UPDATE on its cursor, a migration's lock on the outbox).
	Waits []forwarder.Wait `json:"waits,omitempty"`
}

// ShardState is one shard of the outbox as one relay consumer group sees it.
type ShardState struct {
	// Shard is the shard's number, from 0.
	Shard int `json:"shard"`
	// Owner is the instance id of the relay that owns the shard; "" when no
	// relay does (none running, or a takeover under way).
	Owner string `json:"owner"`
	// Pending counts the shard's committed rows not forwarded yet.
	Pending int64 `json:"pending"`
	// OldestPendingAge is the age of the shard's oldest pending row.
	OldestPendingAge time.Duration `json:"oldest_pending_age_ns"`
}

// OutboxStatus reads the outbox's state for the relay consumer group
// relayGroup ("" means relay.consumer_group).
func (o *Ops) OutboxStatus(ctx context.Context, relayGroup string) (OutboxStatus, error) {
	relayGroup = cmp.Or(relayGroup, o.cfg.Relay.ConsumerGroup)
	if err := names.Topic(relayGroup); err != nil {
		return OutboxStatus{}, fmt.Errorf("millrace: relay consumer group %q: %w", relayGroup, err)
	}
	shards, err := o.tables.RecordedShards(ctx, o.db)
	if err != nil {
		return OutboxStatus{}, err
	}
	var st store.OutboxStatus
	var states []ShardState
	if shards == 1 {
		st, err = o.tables.Status(ctx, o.db, relayGroup)
	} else {
		st, err = o.tables.ShardedStatus(ctx, o.db, relayGroup, shards)
		if err == nil {
			var list []store.ShardStatus
			list, err = o.tables.ShardStatuses(ctx, o.db, relayGroup, shards)
			for _, s := range list {
				states = append(states, ShardState{Shard: s.Shard, Owner: s.Owner, Pending: s.Pending, OldestPendingAge: s.OldestPendingAge})
			}
		}
	}
	if err != nil {
		return OutboxStatus{}, err
	}
	waits, err := o.tables.RelayWaits(ctx, o.db)
	if err != nil {
		return OutboxStatus{}, err
	}
	broker, err := o.tables.RecordedBroker(ctx, o.db)
	if err != nil {
		return OutboxStatus{}, err
	}
	return OutboxStatus{RelayGroup: relayGroup, Pending: st.Pending, OldestPendingAge: st.OldestPendingAge,
		LastForwardedAt: st.LastForwardedAt, Forwarded: st.Forwarded, Quarantined: st.Quarantined,
		Shards: shards, ShardStates: states, Broker: broker, Waits: waits}, nil
}

// OutboxStatuses reads the outbox's state for every relay consumer group
// that has relayed from it, and for relay.consumer_group in any case.
func (o *Ops) OutboxStatuses(ctx context.Context) ([]OutboxStatus, error) {
	groups, err := o.relayGroups(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]OutboxStatus, 0, len(groups))
	for _, g := range groups {
		st, err := o.OutboxStatus(ctx, g)
		if err != nil {
			return nil, err
		}
		out = append(out, st)
	}
	return out, nil
}

// relayGroups lists, sorted, the relay consumer groups that have relayed
// from the outbox, and relay.consumer_group in any case.
func (o *Ops) relayGroups(ctx context.Context) ([]string, error) {
	groups, err := o.tables.RelayGroups(ctx, o.db)
	if err != nil {
		return nil, err
	}
	if !slices.Contains(groups, o.cfg.Relay.ConsumerGroup) {
		groups = append(groups, o.cfg.Relay.ConsumerGroup)
		slices.Sort(groups)
	}
	return groups, nil
}

// InboxPrune says which inbox rows PruneInbox deletes.
type InboxPrune struct {
	// OlderThan deletes rows processed longer ago than this. Required.
	OlderThan time.Duration
	// Group limits the prune to one consumer group; "" prunes every group.
	Group string
	// Batch is the rows one DELETE removes at most. Defaults to
	// consumer.inbox.cleanup_batch.
	Batch int
	// DryRun counts the rows that would be deleted and deletes nothing.
	DryRun bool
}

// InboxPruneResult is what PruneInbox did.
type InboxPruneResult struct {
	DryRun bool `json:"dry_run"`
	// Deleted counts the rows deleted; with DryRun, the rows that would be.
	Deleted   int64  `json:"deleted"`
	OlderThan string `json:"older_than"`
	Group     string `json:"group"`
	Batch     int    `json:"batch"`
	// Warnings say what the prune may cost (a window shorter than
	// consumer.inbox.retention).
	Warnings []string `json:"warnings"`
}

// PruneInbox deletes inbox rows processed longer ago than p.OlderThan, in
// short statements that skip rows a concurrent prune holds. A row that is
// gone no longer deduplicates: a redelivery or replay of its event is
// processed again, hence the warning when p.OlderThan is shorter than
// consumer.inbox.retention.
func (o *Ops) PruneInbox(ctx context.Context, p InboxPrune) (InboxPruneResult, error) {
	res := InboxPruneResult{DryRun: p.DryRun, OlderThan: p.OlderThan.String(), Group: p.Group,
		Batch: cmp.Or(p.Batch, o.cfg.Consumer.Inbox.CleanupBatch), Warnings: []string{}}
	switch {
	case p.OlderThan <= 0:
		return res, fmt.Errorf("millrace: prune inbox: OlderThan must be positive; got %s", p.OlderThan)
	case p.Batch < 0:
		return res, fmt.Errorf("millrace: prune inbox: Batch must be positive; got %d", p.Batch)
	}
	if p.Group != "" {
		if err := names.Topic(p.Group); err != nil {
			return res, fmt.Errorf("millrace: prune inbox: consumer group %q: %w", p.Group, err)
		}
	}
	if retention := o.cfg.Consumer.Inbox.Retention; p.OlderThan < retention {
		res.Warnings = append(res.Warnings, fmt.Sprintf("the prune window (%s) is shorter than consumer.inbox.retention (%s): "+
			"a redelivery or replay of an event whose row is deleted is processed again", p.OlderThan, retention))
	}
	var err error
	if p.DryRun {
		res.Deleted, err = o.tables.CountInboxOlder(ctx, o.db, p.OlderThan, p.Group)
	} else {
		res.Deleted, err = o.tables.PruneInbox(ctx, o.db, p.OlderThan, p.Group, res.Batch)
	}
	if err != nil {
		return res, fmt.Errorf("%w (%d rows deleted before the error)", err, res.Deleted)
	}
	return res, nil
}

// InboxRows counts the inbox rows of each consumer group.
func (o *Ops) InboxRows(ctx context.Context) (map[string]int64, error) {
	return o.tables.InboxRows(ctx, o.db)
}
