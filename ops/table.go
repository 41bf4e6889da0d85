package ops

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/millrace-io/millrace/internal/store"
)

// The dead-letter queue (the poison table) and the relay quarantine have one
// shape: a Filter selects rows to list, a Selection (ids, a Filter or all)
// what a replay or purge acts on, and every list, replay and purge result
// is the same generic type over the table's rows. A Table is either;
// Client.DLQ and Client.Quarantine return them.

// Filter selects rows of a Table; the zero Filter selects all. Handler,
// Group and Fingerprint apply to the DLQ only: the relay quarantine has no
// handlers, consumer groups or failure groups, and refuses them with
// ErrInvalidFilter.
type Filter struct {
	// Topic matches the row's topic: a poisoned message's source topic, a
	// quarantined row's destination topic.
	Topic string
	// Handler and Group match a poisoned message's handler and consumer
	// group (DLQ only).
	Handler, Group string
	// Reason matches rows whose reason contains it, case-insensitively.
	Reason string
	// Since and Until bound when the row was poisoned or quarantined:
	// Since <= t < Until.
	Since, Until TimeBound
	// Replayed, when set, selects rows replayed (true) or not replayed
	// (false); a poisoned message counts as replayed when it was replayed
	// since it was last poisoned.
	Replayed *bool
	// Fingerprint selects the messages of one failure group
	// (Client.PoisonGroups; DLQ only).
	Fingerprint string
}

// IsZero reports whether f selects every row.
func (f Filter) IsZero() bool {
	return f == Filter{}
}

// rowFilter is what f selects by in every table, as the store takes it,
// with ids.
func rowFilter(f Filter, ids []int64) store.RowFilter {
	return store.RowFilter{IDs: ids, Topic: f.Topic, Reason: f.Reason, Since: f.Since.b, Until: f.Until.b, Replayed: f.Replayed}
}

// Selection is what a replay or purge acts on: IDs, a Filter, or All,
// exactly one of them.
type Selection struct {
	// IDs selects these rows; one that does not exist is a *NotFoundError.
	IDs []int64
	// Filter selects the rows it matches.
	Filter Filter
	// All selects every row.
	All bool
	// Limit acts on at most this many matching rows, oldest first (with
	// Filter or All; 0: no limit).
	Limit int
	// Expect, when set, is the Selection token of an earlier result (a dry
	// run's): the action goes ahead only if the selection still holds
	// exactly those rows in the same state, and is a *ChangedError
	// otherwise, changing nothing. It keeps a reviewed action from acting
	// on rows replayed, purged or poisoned again since.
	Expect string
}

// ReplayOptions change how a replay runs.
type ReplayOptions struct {
	// DryRun reports what would be replayed and changes nothing.
	DryRun bool
	// Force also replays what is skipped otherwise: poisoned messages whose
	// event the consumer group's inbox already records (that group acks
	// them as duplicates), and rows the configured broker would refuse
	// (the relay quarantines them again).
	Force bool
	// By names who replays, for the DLQ's replay history (e.g. user@host).
	// Defaults to "unknown".
	By string
}

// List is a page of a Table's rows, newest first.
type List[R any] struct {
	// Rows are the rows of the page.
	Rows []R `json:"rows"`
	// Truncated says more rows match than the limit.
	Truncated bool `json:"truncated"`
}

// ReplayResult is what a replay did (with DryRun: would do). E is a
// replayed row's entry, S a skipped one's.
type ReplayResult[E, S any] struct {
	// DryRun says nothing changed: the result is what would be done.
	DryRun bool `json:"dry_run"`
	// Selection is a token of the selected rows and their state, for
	// Selection.Expect.
	Selection string `json:"selection"`
	// Replayed are the rows replayed (with DryRun: that would be).
	Replayed []E `json:"replayed"`
	// Skipped are the selected rows not replayed, each with the reason.
	Skipped []S `json:"skipped"`
	// Messages counts the messages written to the outbox (with DryRun:
	// that would be). The DLQ writes one per event and topic, however many
	// consumer groups poisoned it.
	Messages int `json:"messages"`
	// Warnings say where a replay will not have the effect one might expect
	// (no inbox, the ordering guard, an event older than the inbox keeps
	// ids, a row the broker still refuses).
	Warnings []string `json:"warnings"`
}

// PurgeResult is what a purge did (with DryRun: would do).
type PurgeResult[R any] struct {
	// DryRun says nothing changed: the result is what would be done.
	DryRun bool `json:"dry_run"`
	// Selection is a token of the selected rows and their state, for
	// Selection.Expect.
	Selection string `json:"selection"`
	// Purged are the rows deleted; with DryRun, those that would be.
	Purged []R `json:"purged"`
}

// Table is the DLQ or the relay quarantine: list, show, replay and purge
// in one shape. R is a row as a list shows it, D a row with its details,
// E and S a replay's replayed and skipped entries. Client.DLQ and
// Client.Quarantine return the two there are; the zero Table is not one.
type Table[R, D, E, S any] struct {
	t table[R, D, E, S]
}

// DLQ is the dead-letter queue, the poison table: messages a consumer
// group's handler failed on for good (Client.DLQ).
type DLQ = Table[PoisonedMessage, PoisonedDetail, ReplayedEntry, SkippedEntry]

// Quarantine is the relay quarantine: outbox rows the relay could not
// publish and no retry would (Client.Quarantine).
type Quarantine = Table[QuarantinedRow, QuarantinedDetail, QuarantinedRow, QuarantineSkipped]

// table is what the DLQ and the relay quarantine do each their own way.
type table[R, D, E, S any] interface {
	list(ctx context.Context, f Filter, limit int) (List[R], error)
	get(ctx context.Context, id int64) (D, error)
	replay(ctx context.Context, tx *sql.Tx, sel Selection, opts ReplayOptions, res *ReplayResult[E, S]) error
	purge(ctx context.Context, tx *sql.Tx, sel Selection, dryRun bool, res *PurgeResult[R]) error
	check(f Filter) error
	// client is the Client whose tables it is.
	client() *Client
}

// List lists the rows f selects, newest first, at most limit of them (0:
// all).
func (t Table[R, D, E, S]) List(ctx context.Context, f Filter, limit int) (List[R], error) {
	if err := t.t.check(f); err != nil {
		return List[R]{}, err
	}
	return t.t.list(ctx, f, limit)
}

// Get returns the row id with its details, or a *NotFoundError.
func (t Table[R, D, E, S]) Get(ctx context.Context, id int64) (D, error) {
	return t.t.get(ctx, id)
}

// Replay sends the selected rows back through the outbox, in one
// transaction; Client.DLQ and Client.Quarantine say how each table does
// it. A selected id that does not exist is a *NotFoundError, and nothing
// changes.
func (t Table[R, D, E, S]) Replay(ctx context.Context, sel Selection, opts ReplayOptions) (ReplayResult[E, S], error) {
	res := ReplayResult[E, S]{DryRun: opts.DryRun, Replayed: []E{}, Skipped: []S{}, Warnings: []string{}}
	if err := t.checkSelection(sel); err != nil {
		return res, err
	}
	err := t.t.client().inTx(ctx, opts.DryRun, "replay", func(tx *sql.Tx) error {
		return t.t.replay(ctx, tx, sel, opts, &res)
	})
	return res, err
}

// Purge deletes the selected rows (and a poisoned message's replay
// history), in one transaction. A selected id that does not exist is a
// *NotFoundError, and nothing changes.
func (t Table[R, D, E, S]) Purge(ctx context.Context, sel Selection, dryRun bool) (PurgeResult[R], error) {
	res := PurgeResult[R]{DryRun: dryRun, Purged: []R{}}
	if err := t.checkSelection(sel); err != nil {
		return res, err
	}
	err := t.t.client().inTx(ctx, dryRun, "purge", func(tx *sql.Tx) error {
		return t.t.purge(ctx, tx, sel, dryRun, &res)
	})
	return res, err
}

func (t Table[R, D, E, S]) checkSelection(sel Selection) error {
	if err := selectionError(sel.IDs, !sel.Filter.IsZero(), sel.All, sel.Limit); err != nil {
		return err
	}
	return t.t.check(sel.Filter)
}

// rows is how one table's rows of store type X, read by store queries of
// type Q, are read and changed: what the two tables share.
type rows[X, R, Q any] struct {
	c *Client
	// what names a row in errors: "poisoned message".
	what string
	// query is the store query of the rows f (and ids, when given)
	// selects, read as r says.
	query func(f Filter, ids []int64, r store.Read) Q
	// read reads the rows q selects.
	read func(ctx context.Context, db store.DBTX, q Q) ([]X, error)
	// id, version and row are a row's id, state (for Selection tokens) and
	// entry in a list.
	id      func(X) int64
	version func(X) string
	row     func(X) R
	// del deletes the rows ids.
	del func(ctx context.Context, db store.DBTX, ids []int64) error
}

func (k rows[X, R, Q]) client() *Client { return k.c }

// list is a page of the rows f selects, newest first.
func (k rows[X, R, Q]) list(ctx context.Context, f Filter, limit int) (List[R], error) {
	read, err := listLimit(limit)
	if err != nil {
		return List[R]{}, err
	}
	found, err := k.read(ctx, k.c.db, k.query(f, nil, store.Read{NewestFirst: true, Limit: read}))
	if err != nil {
		return List[R]{}, err
	}
	var res List[R]
	res.Rows, res.Truncated = page(found, k.row, limit)
	return res, nil
}

// selected reads in tx the rows sel selects (locked unless dryRun) and
// checks them against sel: every id found, and the state Expect names.
// token receives the selection's token once the rows are read, the
// result's Selection.
func (k rows[X, R, Q]) selected(ctx context.Context, tx *sql.Tx, sel Selection, full, dryRun bool, token *string) ([]X, error) {
	found, err := k.read(ctx, tx, k.query(sel.Filter, sel.IDs, store.Read{Full: full, Lock: !dryRun, Limit: sel.Limit}))
	if err != nil {
		return nil, err
	}
	ids := make(map[int64]bool, len(found))
	for _, r := range found {
		ids[k.id(r)] = true
	}
	if err := missingIDs(k.what, sel.IDs, ids); err != nil {
		return nil, err
	}
	*token, err = checkSelection(k.what, found, k.version, sel.Expect)
	return found, err
}

// purge deletes the rows sel selects, unless dryRun.
func (k rows[X, R, Q]) purge(ctx context.Context, tx *sql.Tx, sel Selection, dryRun bool, res *PurgeResult[R]) error {
	found, err := k.selected(ctx, tx, sel, false, dryRun, &res.Selection)
	if err != nil {
		return err
	}
	ids := make([]int64, len(found))
	for i, r := range found {
		ids[i] = k.id(r)
	}
	if len(ids) > 0 && !dryRun {
		if err := k.del(ctx, tx, ids); err != nil {
			return fmt.Errorf("millrace: %w", err)
		}
	}
	res.Purged, _ = page(found, k.row, 0)
	return nil
}

// get reads the row id with its details, or a *NotFoundError.
func (k rows[X, R, Q]) get(ctx context.Context, id int64) (X, error) {
	found, err := k.read(ctx, k.c.db, k.query(Filter{}, []int64{id}, store.Read{Full: true}))
	if err != nil {
		var zero X
		return zero, err
	}
	if len(found) == 0 {
		var zero X
		return zero, &NotFoundError{What: k.what, IDs: []int64{id}}
	}
	return found[0], nil
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

// Error says the selection changed and nothing was done.
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

// String is the bound as RFC 3339, or a duration and "ago"; "" when open.
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
