package store

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Position is a relay's place in the outbox, kept in its cursor row. Every
// committed row whose offset is at or below Offset has been forwarded,
// except the rows of the Pending transactions above their Done offset and
// the rows of transactions from Horizon on, none of which has been
// forwarded. A transaction lands in Pending when a read passes offsets that
// rows of it may hold while it is still in progress (its rows invisible to
// that read); its rows are forwarded once it commits, and it leaves Pending
// once it has ended and none of its rows at or below Offset is left.
type Position struct {
	// Offset is the highest outbox offset the relay's reads have passed.
	Offset int64
	// Pending are the transactions below Horizon whose rows at or below
	// Offset may not all have been forwarded, sorted by transaction id.
	Pending []PendingTx
	// Horizon is the xmax of the snapshot of the read the position comes
	// from: transactions from it on had not ended then, and a snapshot does
	// not list them among those in progress.
	Horizon uint64
}

// PendingTx is a transaction that was in progress when a read passed
// offsets its rows may hold.
type PendingTx struct {
	// XID is the transaction's id (xid8, as the outbox's transaction_id).
	XID uint64
	// Done is the offset up to which its rows were forwarded.
	Done int64
}

// Equal says whether p and q are the same position.
func (p Position) Equal(q Position) bool {
	return p.Offset == q.Offset && p.Horizon == q.Horizon && slices.Equal(p.Pending, q.Pending)
}

// String shows p for logs and errors: "offset 42, horizon 12, pending 7@40, 9@42".
func (p Position) String() string {
	s := "offset " + strconv.FormatInt(p.Offset, 10) + ", horizon " + strconv.FormatUint(p.Horizon, 10)
	if len(p.Pending) == 0 {
		return s
	}
	const shown = 5 // a busy cluster may have hundreds in progress
	parts := make([]string, 0, shown+1)
	for i, tx := range p.Pending {
		if i == shown {
			parts = append(parts, fmt.Sprintf("and %d more", len(p.Pending)-shown))
			break
		}
		parts = append(parts, strconv.FormatUint(tx.XID, 10)+"@"+strconv.FormatInt(tx.Done, 10))
	}
	return s + ", pending " + strings.Join(parts, ", ")
}

// Snapshot is a PostgreSQL snapshot (pg_snapshot): transactions below Xmin
// had ended, those from Xmax on had not begun, and those in Xip were in
// progress.
type Snapshot struct {
	Xmin, Xmax uint64
	// Xip is sorted ascending.
	Xip []uint64
}

// ParseSnapshot reads a pg_snapshot's text form, "xmin:xmax:xip,xip,...".
func ParseSnapshot(s string) (Snapshot, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return Snapshot{}, fmt.Errorf("snapshot %q: want xmin:xmax:xip", s)
	}
	var snap Snapshot
	var err error
	if snap.Xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: xmin: %w", s, err)
	}
	if snap.Xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: xmax: %w", s, err)
	}
	if parts[2] != "" {
		for _, f := range strings.Split(parts[2], ",") {
			x, err := strconv.ParseUint(f, 10, 64)
			if err != nil {
				return Snapshot{}, fmt.Errorf("snapshot %q: xip: %w", s, err)
			}
			snap.Xip = append(snap.Xip, x)
		}
	}
	slices.Sort(snap.Xip)
	return snap, nil
}

// running says whether transaction x had not ended as of s.
func (s Snapshot) running(x uint64) bool {
	if x >= s.Xmax {
		return true
	}
	_, found := slices.BinarySearch(s.Xip, x)
	return found
}

// Batch is what one read of the outbox returned: up to a limit of rows in
// offset order, and the snapshot the read saw them under.
type Batch struct {
	Rows []OutboxRow
	// Snapshot is the read's snapshot.
	Snapshot Snapshot
	// Young are the transactions from the position's Horizon on that had
	// ended at the read and have rows at or below the position's Offset.
	Young []uint64
	// Complete says the read returned every row it could (fewer than its
	// limit).
	Complete bool
}

// Advance returns the position after the relay forwarded the first
// forwarded rows of b, a batch read at p. It is the whole of the read rule's
// bookkeeping; the argument that it never skips a committed row is in
// forwarder/doc.go. wholeOutbox says the read saw every shard's rows, so that
// an unbroken run of offsets proves that no row in progress hides among them.
func (p Position) Advance(b Batch, forwarded int, wholeOutbox bool) Position {
	next := Position{Offset: p.Offset, Horizon: max(p.Horizon, b.Snapshot.Xmax)}
	// frontier: every committed row of an ended pending or young
	// transaction at or below it has been forwarded; -1 when the batch says
	// nothing of them.
	frontier := int64(-1)
	switch {
	case forwarded > 0:
		last := b.Rows[forwarded-1].Offset
		next.Offset = max(p.Offset, last)
		frontier = last
		if forwarded == len(b.Rows) && b.Complete {
			frontier = next.Offset
		}
	case len(b.Rows) == 0 && b.Complete:
		frontier = p.Offset
	}
	keep := func(x uint64, done int64) {
		if done < next.Offset {
			next.Pending = append(next.Pending, PendingTx{XID: x, Done: done})
		}
	}
	for _, tx := range p.Pending {
		if b.Snapshot.running(tx.XID) {
			next.Pending = append(next.Pending, tx)
			continue
		}
		keep(tx.XID, max(tx.Done, min(frontier, next.Offset)))
	}
	for _, x := range b.Young {
		keep(x, max(0, min(frontier, next.Offset)))
	}
	passed := next.Offset > p.Offset && !(wholeOutbox && unbroken(b.Rows[:forwarded], p.Offset, next.Offset))
	for _, x := range b.Snapshot.Xip {
		switch {
		case x >= p.Horizon:
			keep(x, 0) // young and in progress: none of its rows was forwarded
		case passed && !slices.ContainsFunc(next.Pending, func(tx PendingTx) bool { return tx.XID == x }):
			// Offsets in (p.Offset, next.Offset] the read did not see
			// belong to transactions in progress at its snapshot (a row's
			// offset is drawn when it is inserted, before any row read
			// after it was committed): those listed in it, and those from
			// its xmax on, which next.Horizon covers.
			next.Pending = append(next.Pending, PendingTx{XID: x, Done: p.Offset})
		}
	}
	slices.SortFunc(next.Pending, func(a, b PendingTx) int { return cmpUint(a.XID, b.XID) })
	return next
}

// unbroken says whether rows holds every offset from after through upto,
// each once: then no row the read could not see lies in that range.
func unbroken(rows []OutboxRow, after, upto int64) bool {
	n := int64(0)
	for _, r := range rows {
		if r.Offset > after {
			n++
		}
	}
	return n == upto-after
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// pendingArrays are p's pending transactions as two PostgreSQL array
// literals (xid8[] and bigint[]), sent as text: one form that every pgx
// query exec mode and a pooler pass unchanged.
func (p Position) pendingArrays() (xids, done string) {
	var x, d strings.Builder
	x.WriteByte('{')
	d.WriteByte('{')
	for i, tx := range p.Pending {
		if i > 0 {
			x.WriteByte(',')
			d.WriteByte(',')
		}
		x.WriteString(strconv.FormatUint(tx.XID, 10))
		d.WriteString(strconv.FormatInt(tx.Done, 10))
	}
	x.WriteByte('}')
	d.WriteByte('}')
	return x.String(), d.String()
}

// parsePending reads the two array literals pendingArrays writes.
func parsePending(xids, done string) ([]PendingTx, error) {
	xs, ds := splitArray(xids), splitArray(done)
	if len(xs) != len(ds) {
		return nil, fmt.Errorf("pending transactions %s and their offsets %s differ in length", xids, done)
	}
	out := make([]PendingTx, len(xs))
	for i := range xs {
		x, err := strconv.ParseUint(xs[i], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("pending transaction %q: %w", xs[i], err)
		}
		d, err := strconv.ParseInt(ds[i], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("pending offset %q: %w", ds[i], err)
		}
		out[i] = PendingTx{XID: x, Done: d}
	}
	return out, nil
}

// splitArray splits a one-dimensional PostgreSQL array literal of numbers.
func splitArray(s string) []string {
	s = strings.TrimSuffix(strings.TrimPrefix(s, "{"), "}")
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}
