package middleware

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/millrace-io/millrace/internal/fault"
	"github.com/millrace-io/millrace/internal/store"
)

// errBatchAborted is what a message of a batch gets when the batch's
// transaction ended for another message's sake (or at the earliest
// handler_timeout of its messages) before the message's effect was
// committed: it was never judged, and joins the next batch. Retryable, in
// case its own handler_timeout has passed too.
var errBatchAborted = errors.New("inbox: the message's batch ended before its effect was committed, through no fault of the message")

// errRunAlone is what the messages whose savepoints were kept get when the
// batch fails in a way no single message can be blamed for (a statement
// after theirs finds the transaction failed, the COMMIT fails): one of them
// may have left the transaction failed, so each is tried again in a
// transaction of its own, which tells.
var errRunAlone = fmt.Errorf("%w; trying it again in a transaction of its own", errBatchAborted)

// batcher is the group commit of one chain's inbox transactions. The
// messages that reach the transaction stage within batch.max_wait of each
// other (up to the batch limit) form a batch, which runs at once when every
// message in the chain is in it and no message that just left the chain
// may have a successor on its way (see freed: at a trickle, and on a
// single ordered subscription, nothing waits).
// A goroutine of the batch
// begins one transaction and gives each message its turn in a savepoint of
// its own, in the order they joined, then commits once. Each message's
// effect runs in the message's own goroutine (its attempt), which waits for
// the COMMIT before it returns and so before the message is acked.
//
// Per-aggregate order: an ordered handler has one message per aggregate in
// flight (the Dispatcher), so a batch holds at most one message of each
// aggregate, and the next is released only after the batch's COMMIT and ack.
type batcher struct {
	c    *Chain
	wait time.Duration
	// limit is the most messages in one batch: batch.max_messages, lowered
	// to what can be in flight at once (workers; 1 for an ordered handler
	// on a single subscription of a stock subscriber).
	limit atomic.Int64
	// handler is the chain's batch handler (WrapBatch); nil when each
	// message has its own handler call in its savepoint.
	handler BatchHandlerFunc

	mu      sync.Mutex
	forming *batch // the batch messages join now; nil when none is open
	// inChain counts the messages in the chain (between the observe
	// stage's start and end).
	inChain int
	// freed holds when messages left the chain, oldest first, one entry
	// per message whose successor has not entered yet: a subscription
	// hands over its next message a broker round trip after the ack, so
	// for batch.max_wait after a message left, another is likely on its
	// way. A batch holding every message in the chain, with none of those
	// on their way, waits no longer: no other message can come before one
	// of them is acked (at a trickle, nothing waits).
	freed []time.Time
}

// enter and leave count a message into and out of the chain.
func (b *batcher) enter() {
	b.mu.Lock()
	b.inChain++
	if b.coming() > 0 { // the successor of the oldest message that left
		b.freed = b.freed[1:]
	}
	b.mu.Unlock()
}

func (b *batcher) leave() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.inChain--
	if int64(len(b.freed)) < b.limit.Load() {
		b.freed = append(b.freed, time.Now())
	}
	b.closeIfComplete()
}

// closeIfComplete closes the forming batch when it is full, or when it
// holds every message in the chain and no message left the chain within
// batch.max_wait without a successor. b.mu is held.
func (b *batcher) closeIfComplete() {
	bt := b.forming
	if bt == nil {
		return
	}
	n := len(bt.members)
	if int64(n) >= b.limit.Load() || n >= b.inChain+b.coming() {
		close(bt.full)
		b.forming = nil
	}
}

// coming is how many messages may be on their way: those that left the
// chain within batch.max_wait and have no successor yet. b.mu is held.
func (b *batcher) coming() int {
	since := time.Now().Add(-b.wait)
	i := 0
	for i < len(b.freed) && b.freed[i].Before(since) {
		i++
	}
	b.freed = b.freed[i:]
	return len(b.freed)
}

func newBatcher(c *Chain) *batcher {
	b := &batcher{c: c, wait: c.cfg.Batch.MaxWait}
	b.limit.Store(int64(min(c.cfg.Batch.MaxMessages, c.cfg.Workers)))
	return b
}

// batch is one group of messages sharing a transaction.
type batch struct {
	members []*member
	full    chan struct{} // closed when it is to run without waiting longer
}

// member is one message of a batch as the batch's goroutine sees it. The
// channels have room for one value, so the batch never blocks on a member.
type member struct {
	eventID  string
	deadline time.Time        // the end of its attempt
	turn     chan Transaction // its savepoint is set: run
	result   chan stepResult  // what it did in its turn
	done     chan error       // nil: committed; or why not
	// in is the message in its attempt, for a batch handler; outcome is
	// what its step did (OutcomeOK: it is for the batch handler).
	in      *inflight
	outcome string
	// inboxed is set before its turn when the batch inserted its inbox row
	// already (insertInbox): its step skips the insert.
	inboxed bool
}

// join adds m to the batch being formed, opening one (and starting its
// goroutine) when none is.
func (b *batcher) join(m *member) {
	b.mu.Lock()
	defer b.mu.Unlock()
	bt := b.forming
	if bt == nil {
		bt = &batch{full: make(chan struct{})}
		b.forming = bt
		go b.run(bt)
	}
	bt.members = append(bt.members, m)
	b.closeIfComplete()
}

// transactionBatched is the inbox stage with batch.max_messages above 1: the
// transaction stage's work (see transaction) in the savepoint of a batch.
func (c *Chain) transactionBatched(next step) step {
	single := c.transaction(next)
	b := c.batcher
	if b.handler != nil {
		// Each message's turn is its inbox insert and ordering guard; the
		// batch handler runs once for them all (see runHandler).
		next = func(*inflight) error { return nil }
	}
	return func(in *inflight) error {
		if b.limit.Load() <= 1 {
			return single(in)
		}
		msg := in.msg
		ctx := msg.Context()
		a := in.a
		deadline, _ := ctx.Deadline() // the attempt stage set handler_timeout
		for {
			m := &member{
				eventID:  a.eventID,
				deadline: deadline,
				turn:     make(chan Transaction, 1),
				result:   make(chan stepResult, 1),
				done:     make(chan error, 1),
				in:       in,
			}
			b.join(m)
			var err error
			select {
			case tx := <-m.turn:
				r := c.runStep(in, tx, next, m.inboxed)
				m.result <- r
				err = <-m.done
				if err == nil {
					a.outcome = r.outcome
					return nil
				}
			case err = <-m.done:
				if err == nil { // settled by the batch alone (executeBulk)
					a.outcome = m.outcome
					return nil
				}
			}
			switch {
			case !errors.Is(err, errBatchAborted):
				return err
			case ctx.Err() != nil:
				return fmt.Errorf("%w, and handler_timeout has passed", err)
			case errors.Is(err, errRunAlone):
				return single(in)
			}
		}
	}
}

// runStep is step that reports a runtime.Goexit in the handler (a test
// simulating a dead process) as a failure, so the batch goes on without it.
func (c *Chain) runStep(m *inflight, tx Transaction, next step, inboxed bool) (r stepResult) {
	returned := false
	defer func() {
		if !returned {
			r = stepResult{err: errors.New("the handler ended its goroutine"), byHandler: true}
		}
	}()
	r = c.step(m, tx, next, inboxed)
	returned = true
	return r
}

// run waits until bt is full, holds every message in the chain, or
// batch.max_wait has passed since its first message, then runs it.
func (b *batcher) run(bt *batch) {
	timer := time.NewTimer(b.wait)
	select {
	case <-bt.full:
	case <-timer.C:
	}
	timer.Stop()
	b.mu.Lock()
	if b.forming == bt {
		b.forming = nil
	}
	members := bt.members
	b.mu.Unlock()
	b.c.batchSize.Observe(float64(len(members)))
	b.execute(members)
}

// await returns what members[i] did in its turn; false when ctx ended
// first. When the turn takes longer than a tenth of handler_timeout, the
// members after it, not run yet, leave the batch for another one, so that
// a slow or stuck handler delays only the messages whose effects already
// wait for this batch's COMMIT.
func (b *batcher) await(ctx context.Context, m *member, members *[]*member, i int) (stepResult, bool) {
	slow := time.NewTimer(b.c.cfg.HandlerTimeout / 10)
	defer slow.Stop()
	for {
		select {
		case r := <-m.result:
			return r, true
		case <-slow.C:
			for _, later := range (*members)[i+1:] {
				later.done <- errBatchAborted
			}
			*members = (*members)[:i+1]
		case <-ctx.Done():
			return stepResult{}, false
		}
	}
}

// execute runs members in one transaction. The transaction's context ends
// at the earliest deadline of their attempts: after it, nothing of the batch
// commits (see transaction).
func (b *batcher) execute(members []*member) {
	members = b.leaveDuplicates(members)
	ctx, cancel := context.WithDeadline(context.Background(), earliestDeadline(members))
	defer cancel()
	tx, ok := b.beginInboxed(ctx, members)
	if !ok {
		return
	}
	all := members // members is cut short when a slow turn sends the rest away
	kept, members, ok := b.takeTurns(ctx, tx, members)
	if !ok {
		return
	}
	if len(kept) == 0 {
		_ = tx.Rollback()
		return
	}
	if err := b.uninbox(ctx, tx, all[len(members):]); err != nil {
		abortBatch(tx, kept, nil, err)
		return
	}
	if b.handler != nil && !b.runHandler(ctx, tx, kept) {
		return
	}
	b.commit(ctx, tx, kept)
}

// earliestDeadline is the earliest deadline of members' attempts.
func earliestDeadline(members []*member) time.Time {
	deadline := members[0].deadline
	for _, m := range members[1:] {
		if m.deadline.Before(deadline) {
			deadline = m.deadline
		}
	}
	return deadline
}

// beginInboxed begins the batch's transaction with the members' inbox
// rows, when it can insert them all at once. It returns false when the
// batch is over: no transaction could begin, or executeBulk ran it.
func (b *batcher) beginInboxed(ctx context.Context, members []*member) (Transaction, bool) {
	tx := b.begin(ctx, members)
	if tx == nil {
		return nil, false
	}
	switch b.inboxAll(ctx, tx, members) {
	case inboxedAll:
		if b.handler != nil {
			b.executeBulk(ctx, tx, members)
			return nil, false
		}
	case inboxedNone:
		// A duplicate among them, or a failure: each turn inserts its own
		// row, in a transaction without the batch's INSERT.
		_ = tx.Rollback()
		if tx = b.begin(ctx, members); tx == nil {
			return nil, false
		}
	}
	return tx, true
}

// takeTurns runs members one after another in tx, each behind its own
// savepoint, and tells each failed one its error. It returns the members
// whose effects wait for the COMMIT (kept) and members, cut short when a
// slow turn sent the rest away; false when the batch is over, every
// member told.
func (b *batcher) takeTurns(ctx context.Context, tx Transaction, members []*member) (kept, _ []*member, ok bool) {
	for i := 0; i < len(members); i++ {
		m := members[i]
		if err := store.Savepoint(ctx, tx); err != nil {
			abortBatch(tx, kept, members[i:], err)
			return nil, nil, false
		}
		m.turn <- tx
		r, ok := b.await(ctx, m, &members, i)
		if !ok {
			// A handler still running at the deadline may still use tx,
			// which a pgx transaction does not allow concurrently with a
			// Rollback: the others go now, nothing of the batch commits,
			// and tx is rolled back once the handler returns (database/sql
			// has rolled it back already with its context; pgx's server
			// ends it at idle_in_transaction_session_timeout).
			releaseBatch(kept, members[i:], ctx.Err())
			<-m.result
			_ = tx.Rollback()
			return nil, nil, false
		}
		if r.err == nil {
			m.outcome = r.outcome
			kept = append(kept, m)
			continue
		}
		if undo := b.undoTurn(ctx, tx, m, r); undo != nil {
			abortBatch(tx, kept, members[i+1:], undo)
			return nil, nil, false
		}
		m.done <- r.err // its effect is undone; the others go on
	}
	return kept, members, true
}

// undoTurn undoes the effects of m, whose turn failed with r, back to its
// savepoint. When it cannot, it tells m and returns why: the batch cannot
// go on.
func (b *batcher) undoTurn(ctx context.Context, tx Transaction, m *member, r stepResult) error {
	undo := store.RollbackToSavepoint(ctx, tx)
	if undo == nil && m.inboxed {
		// Its inbox row was inserted before its savepoint: it goes too,
		// so that the message can be tried again.
		undo = b.uninbox(ctx, tx, []*member{m})
	}
	if undo == nil {
		return nil
	}
	switch {
	case errors.Is(undo, sql.ErrTxDone) && r.byHandler:
		// The handler ended the transaction itself.
		m.done <- fault.Permanent(errTxEnded)
	case unreachable(undo) && r.byHandler && IsRetryable(r.err):
		m.done <- &unavailableError{err: r.err}
	default:
		m.done <- r.err
	}
	return undo
}

// releaseBatch sends kept, the members whose effects waited for the
// COMMIT, and rest, those not run, their verdict once the transaction will
// not commit.
func releaseBatch(kept, rest []*member, cause error) {
	if unreachable(cause) {
		down := &unavailableError{err: cause}
		for _, m := range append(kept, rest...) {
			m.done <- down
		}
		return
	}
	for _, m := range kept {
		m.done <- errRunAlone
	}
	for _, m := range rest {
		m.done <- errBatchAborted
	}
}

// abortBatch rolls tx back, then releases kept and rest (see releaseBatch).
func abortBatch(tx Transaction, kept, rest []*member, cause error) {
	_ = tx.Rollback()
	releaseBatch(kept, rest, cause)
}

// commit commits tx, begun on ctx, and tells kept, the members whose
// effects it holds, whether it did.
func (b *batcher) commit(ctx context.Context, tx Transaction, kept []*member) {
	if err := tx.Commit(); err != nil {
		if ctx.Err() != nil || unreachable(err) {
			err = commitError(ctx, err)
			for _, m := range kept {
				m.done <- err
			}
			return
		}
		// A handler ended or failed the transaction: which of the kept
		// messages landed is unknown; each tries again alone, and the
		// inbox tells those that did.
		for _, m := range kept {
			m.done <- errRunAlone
		}
		return
	}
	for _, m := range kept {
		m.done <- nil
	}
}

// leaveDuplicates sends away the members whose event id an earlier member
// of the batch has (a redelivery while the first delivery is in flight):
// they join another batch, where the inbox tells whether the first
// committed.
func (b *batcher) leaveDuplicates(members []*member) []*member {
	seen := make(map[string]bool, len(members))
	kept := members[:0:0]
	for _, m := range members {
		if seen[m.eventID] {
			m.done <- errBatchAborted
			continue
		}
		seen[m.eventID] = true
		kept = append(kept, m)
	}
	return kept
}

// begin begins the transaction of members, begun on ctx; when it cannot,
// it tells every member so and returns nil.
func (b *batcher) begin(ctx context.Context, members []*member) Transaction {
	tx, err := b.c.stack.begin(ctx)
	if err == nil {
		return tx
	}
	// When the earliest deadline among them passed (waiting for a
	// connection), each tries again until its own.
	verdict := errBatchAborted
	if ctx.Err() == nil {
		verdict = ownStatement(fmt.Errorf("inbox: begin transaction: %w", err))
	}
	for _, m := range members {
		m.done <- verdict
	}
	return nil
}

// uninbox deletes from tx the inbox rows that inboxAll inserted for left,
// members whose effects this batch will not commit (a failed member, those
// a slow turn sent to another batch): committed without their effects, the
// rows would make those messages duplicates of themselves, acked without
// an effect.
func (b *batcher) uninbox(ctx context.Context, tx Transaction, left []*member) error {
	var ids []string
	for _, m := range left {
		if m.inboxed {
			ids = append(ids, m.eventID)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	return b.c.stack.tables.UnmarkProcessed(ctx, tx, b.c.spec.ConsumerGroup, ids...)
}

// inboxOutcome is what inboxAll did.
type inboxOutcome int

const (
	inboxSkipped inboxOutcome = iota // not tried: each turn inserts its row
	inboxedAll                       // every member's row is inserted
	inboxedNone                      // tried and failed: tx is to be rolled back
)

// inboxAll is the short way of a batch when the inbox is on and the
// ordering guard off: one INSERT of every member's inbox row, first in tx,
// instead of one per member's turn, so that a turn is only the savepoint
// and the handler (and a batch handler's batch needs no turns). When the
// INSERT does not add a row for every member (a duplicate among them: the
// turns tell which) or fails (the turns meet the failure again and settle
// it) it reports inboxedNone, and tx, which holds nothing else, is to be
// rolled back.
func (b *batcher) inboxAll(ctx context.Context, tx Transaction, members []*member) inboxOutcome {
	c := b.c
	if !*c.cfg.Inbox.Enabled || *c.cfg.OrderingGuard {
		return inboxSkipped
	}
	ids := make([]string, len(members))
	for i, m := range members {
		ids[i] = m.eventID
	}
	// Sorted, so that batches sharing ids lock their rows in one order.
	slices.Sort(ids)
	added, err := c.stack.tables.MarkProcessedAll(ctx, tx, c.spec.ConsumerGroup, ids)
	if err != nil || added != int64(len(ids)) {
		return inboxedNone
	}
	for _, m := range members {
		m.inboxed = true
	}
	return inboxedAll
}
