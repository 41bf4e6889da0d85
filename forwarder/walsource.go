package forwarder

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/forwarder/wal"
	"github.com/millrace-io/millrace/internal/confload"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/sleep"
	"github.com/millrace-io/millrace/internal/store"
)

// The values of relay.source.
const (
	// SourceTable polls the outbox table, woken by NOTIFY (the default).
	SourceTable = "table"
	// SourceWAL streams the outbox's inserts from a logical replication
	// slot (package wal).
	SourceWAL = "wal"
)

// validateSource checks relay.source and relay.wal_slot.
func (c Config) validateSource(chk *confload.Checker, at func(string) string) {
	chk.OneOf(at("source"), c.Source, SourceTable, SourceWAL)
	switch {
	case c.WALSlot == "":
	case c.Source != SourceWAL:
		chk.Add(at("wal_slot"), "set while relay.source is %q: it names the slot of relay.source: wal only", c.Source)
	default:
		chk.Check(at("wal_slot"), names.Identifier(c.WALSlot, store.MaxIdentifierLength))
	}
}

// OutboxShards is the shard count the outbox table is written with:
// relay.shards, except with relay.source: wal, whose one slot streams to
// one active relay that splits each batch into relay.shards lanes in
// process (see Shards): its outbox is one shard.
func (c Config) OutboxShards() int {
	if c.Source == SourceWAL {
		return 1
	}
	return *c.Shards
}

// SlotName is the replication slot of relay.source: wal for the outbox
// of topic outboxTopic in schema: relay.wal_slot, else the name derived
// from the consumer group, the schema and the topic (see WALSlot), which
// is always a valid slot name.
func (c Config) SlotName(schema, outboxTopic string) string {
	if c.WALSlot != "" {
		return c.WALSlot
	}
	return names.Derived(store.MaxIdentifierLength, cmp.Or(c.ConsumerGroup, "millrace_relay"), schema, outboxTopic)
}

// walSource is what a relay with relay.source: wal adds to the table relay:
// the reader's config and the gauge of the WAL its slot retains.
type walSource struct {
	cfg      wal.Config
	retained prometheus.Gauge
	busy     atomic.Bool // a batch is in the handler
	// reader is made once, by the relay's goroutine (walReader).
	reader *wal.Reader
	// caughtUpTo is the outbox's highest offset when the catch-up of the
	// current stream began: the slot's rows at or below it may have been
	// forwarded by the catch-up (see relayedAlready).
	caughtUpTo int64
	// lanes publish a batch's rows by aggregate, relay.shards at once;
	// made at the first batch (see walLanes), none with relay.shards: 1.
	lanes []*Forwarder
}

// newWALSource prepares the WAL source of the outbox tables on the
// replication connection url, registering its gauge with reg.
func newWALSource(cfg Config, tables store.Tables, url string, reg prometheus.Registerer) (*walSource, error) {
	if url == "" {
		return nil, errors.New("forwarder: relay.source: wal needs Options.ReplicationURL (database.direct_url, else database.url)")
	}
	s := &walSource{
		cfg: wal.Config{URL: url, Schema: tables.Schema, OutboxTopic: tables.OutboxTopic,
			Slot: cfg.SlotName(tables.Schema, tables.OutboxTopic), MaxBatchEvents: cfg.BatchSize,
			// The events of outbox.mode: wal_messages; none in table mode.
			MessagePrefix: tables.MessagePrefix(),
			// Confirm soon after each batch: a relay that dies replays
			// from the last position it confirmed.
			StatusInterval: cfg.PollInterval},
		retained: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_relay_wal_retained_bytes", ConstLabels: prometheus.Labels{"outbox": tables.OutboxNotifyPayload()},
			Help: "WAL the relay's replication slot keeps on the server's disk (pg_current_wal_lsn() - restart_lsn), as last measured by the active relay (every relay.backlog_interval; relay.source: wal).",
		}),
	}
	if reg != nil {
		if err := reg.Register(s.retained); err != nil {
			return nil, fmt.Errorf("forwarder: register metrics: %w", err)
		}
	}
	return s, nil
}

// prepareWAL readies the WAL source at the relay's start, standby or not:
// it checks the requirements and creates the publication and the slot when
// missing (wal.New), once. A missing requirement, which no retry fixes, is
// returned; any other failure (an unreachable server) is logged and left
// to the retries, and streamWAL prepares the reader at the lease then.
func (f *Forwarder) prepareWAL(ctx context.Context) error {
	if f.wal == nil {
		return nil
	}
	_, err := f.walReader(ctx)
	if walFatal(err) {
		return err
	}
	if err != nil && ctx.Err() == nil {
		f.logger.Error("Could not prepare the WAL relay's slot; retrying at the lease", err, nil)
	}
	return nil
}

// walReader is the reader of the slot, made by the first call that
// succeeds (wal.New): later lease rounds reuse it, so that a slot dropped
// while the relay runs is reported (wal.ErrNoSlot) rather than created
// again behind the operator's back.
func (f *Forwarder) walReader(ctx context.Context) (*wal.Reader, error) {
	if f.wal.reader != nil {
		return f.wal.reader, nil
	}
	r, err := wal.New(ctx, f.wal.cfg)
	switch {
	case walFatal(err):
		return nil, fmt.Errorf("relay.source: wal: %w", err)
	case err != nil:
		return nil, fmt.Errorf("forwarder: %w", err)
	}
	f.wal.reader = r
	return r, nil
}

// walFatal tells whether err is one of the WAL source's errors that only
// an operator fixes, for which Run returns at once.
func walFatal(err error) bool {
	for _, target := range []error{wal.ErrWALLevel, wal.ErrNoReplicationPrivilege, wal.ErrNoSenders, wal.ErrSlotLost, wal.ErrNoSlot, wal.ErrPublication} {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// streamWAL forwards the batches of the slot while the relay holds the
// lease: until ctx ends (nil), the LISTEN connection the lease is tied to
// ends, or the reader fails. The slot lets one reader at a time stream it,
// and the lease makes that reader the active relay.
func (f *Forwarder) streamWAL(ctx context.Context, lost <-chan struct{}) error {
	r, err := f.walReader(ctx)
	if err != nil {
		return err
	}
	// Read before the catch-up, which deletes what it forwarded.
	if f.wal.caughtUpTo, err = f.tables.MaxOffset(ctx, f.db); err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	if err := f.catchUp(ctx); err != nil {
		if errors.Is(err, store.ErrLeaseLost) {
			return fmt.Errorf("%w: %v", errLeadershipLost, err)
		}
		return fmt.Errorf("forwarder: catch up with the outbox table: %w", err)
	}
	runCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() {
		select {
		case <-lost:
			cancel(fmt.Errorf("%w: the LISTEN connection ended", errLeadershipLost))
		case <-runCtx.Done():
		}
	}()
	refreshed := make(chan struct{})
	go func() { defer close(refreshed); f.refreshWAL(runCtx, r.Slot()) }()
	f.logger.Info("Relay streams the outbox from its replication slot", watermill.LogFields{"slot": r.Slot()})
	err = f.runReader(runCtx, r)
	cancel(nil)
	<-refreshed
	switch cause := context.Cause(runCtx); {
	case ctx.Err() != nil:
		return nil
	case errors.Is(cause, errLeadershipLost):
		return cause
	case errors.Is(err, wal.ErrNoSlot):
		return fmt.Errorf("relay.source: wal: %w; then start the relay again: it forwards what the outbox table "+
			"still holds before it streams (duplicates possible, no loss); `millrace wal create-slot` creates the slot", err)
	case walFatal(err):
		return fmt.Errorf("relay.source: wal: %w", err)
	}
	return err
}

// walSlotPoll is how often runReader asks again for a slot another
// connection reads.
const walSlotPoll = 50 * time.Millisecond

// runReader runs r until ctx ends or r fails. A slot another connection
// still reads is asked for again every walSlotPoll, for up to lease_ttl,
// keeping the lease and the catch-up done: after a relay died, its WAL
// sender holds the slot until PostgreSQL notices (from a few milliseconds
// to a moment on a loaded server). Before, the new relay gave its lease
// up, backed off and caught up again each time.
func (f *Forwarder) runReader(ctx context.Context, r *wal.Reader) error {
	var since time.Time
	for {
		err := r.Run(ctx, f.forwardWAL)
		switch {
		case !errors.Is(err, wal.ErrSlotActive) || ctx.Err() != nil:
			return err
		case since.IsZero():
			since = time.Now()
			f.logger.Info("Replication slot still read by another connection, such as the WAL sender of a relay that died "+
				"until PostgreSQL notices; asking again every "+walSlotPoll.String()+" for up to relay.lease_ttl",
				watermill.LogFields{"slot": r.Slot(), "error": err.Error()})
		case time.Since(since) >= f.cfg.LeaseTTL:
			return err
		}
		if !sleep.For(ctx, walSlotPoll) {
			return err
		}
	}
}

// catchUp forwards what the outbox table holds past the relay's cursor,
// through the table relay's path, once the slot exists and before the
// stream starts, and deletes it: the rows committed before the slot was
// created (a first start, or a switch from relay.source: table), which are
// in no slot. Rows committed since are also in the slot and come again
// (duplicates, which consumers' inboxes drop); the rows a previous WAL
// relay confirmed are deleted already. One read when nothing is pending.
func (f *Forwarder) catchUp(ctx context.Context) error {
	defer f.dropAhead()
	for ctx.Err() == nil {
		n, err := f.forwardBatch(ctx)
		if err != nil {
			return err
		}
		if n < f.cfg.BatchSize {
			break
		}
	}
	if err := f.flush(ctx); err != nil {
		return err
	}
	for ctx.Err() == nil {
		n, err := f.DeleteForwarded(ctx, 0, f.cfg.CleanupBatch)
		if err != nil {
			return err
		}
		f.metrics.deleted.Add(float64(n))
		if n < int64(f.cfg.CleanupBatch) {
			break
		}
	}
	return nil
}

// refreshWAL measures the WAL the slot retains every backlog_interval,
// and ticks the relay's health every poll_interval while no batch is in
// the handler (a batch ticks it when done, or at each retry).
func (f *Forwarder) refreshWAL(ctx context.Context, slot string) {
	measure := time.NewTicker(f.cfg.BacklogInterval)
	defer measure.Stop()
	beat := time.NewTicker(f.cfg.PollInterval)
	defer beat.Stop()
	for {
		st, err := wal.Status(ctx, f.wal.cfg.URL, slot)
		switch {
		case err == nil:
			f.wal.retained.Set(float64(st.RetainedBytes))
		case ctx.Err() == nil:
			f.logger.Error("Could not measure the WAL the relay's slot retains", err, watermill.LogFields{"slot": slot})
		}
		if !f.awaitMeasure(ctx, measure.C, beat.C) {
			return
		}
	}
}

// awaitMeasure ticks the health on each beat while no batch is in the
// handler, until the next measurement is due (true) or ctx ends (false).
func (f *Forwarder) awaitMeasure(ctx context.Context, measure, beat <-chan time.Time) bool {
	for {
		select {
		case <-ctx.Done():
			return false
		case <-measure:
			return true
		case <-beat:
			if !f.wal.busy.Load() {
				f.health.beat()
			}
		}
	}
}

// forwardWAL is the reader's handler: it unwraps the batch's outbox rows,
// publishes them (retrying what the broker could not take for now), and
// deletes them from the outbox, moving those the broker refused for good
// to the quarantine, in one transaction. It returns nil, so that the slot
// confirms the batch, only after all that. A stopping relay gives the
// batch shutdown_timeout to finish; a batch abandoned comes again.
func (f *Forwarder) forwardWAL(ctx context.Context, b wal.Batch) error {
	if err := ctx.Err(); err != nil {
		return context.Cause(ctx) // stopping: the batch comes again
	}
	f.wal.busy.Store(true)
	defer f.wal.busy.Store(false)
	work, release := f.graceContext(ctx)
	defer release()

	// The slot may stream a transaction before a statement sees its rows:
	// the lookup and the delete below must see them.
	if err := f.tables.AwaitVisible(work, f.db, walXIDs(b)); err != nil {
		return err
	}
	read, err := f.relayedAlready(work, walRows(b))
	if err != nil {
		return err
	}
	rows, foreign := f.ownRows(f.unwrap(read))
	if rows, err = f.publishWAL(work, rows); err != nil {
		return err
	}
	if err := f.finishWAL(work, rows); err != nil {
		return err
	}
	f.health.beat()
	return foreign // rows of another broker.kind: Run stops, the batch is not confirmed
}

// relayedAlready drops from rows those the catch-up forwarded, which the
// slot streams again: a row at or below caughtUpTo that is no longer in
// the outbox was deleted after the broker confirmed it (or moved to the
// quarantine). One lookup per batch while the slot streams such rows.
func (f *Forwarder) relayedAlready(ctx context.Context, rows []store.OutboxRow) ([]store.OutboxRow, error) {
	var early []int64
	for _, r := range rows {
		if r.Offset > 0 && r.Offset <= f.wal.caughtUpTo {
			early = append(early, r.Offset)
		}
	}
	if len(early) == 0 {
		return rows, nil
	}
	present, err := f.tables.PresentOffsets(ctx, f.db, early)
	if err != nil {
		return nil, err
	}
	kept := rows[:0:0]
	for _, r := range rows {
		if r.Offset == 0 || r.Offset > f.wal.caughtUpTo || present[r.Offset] {
			kept = append(kept, r)
		}
	}
	return kept, nil
}

// walXIDs are the transaction ids (xid8) of b's outbox table rows, once
// each; the logical messages of outbox.mode: wal_messages are in no table.
func walXIDs(b wal.Batch) []uint64 {
	var xids []uint64
	for _, t := range b.Transactions {
		for _, e := range t.Events {
			if e.Row != nil && (len(xids) == 0 || xids[len(xids)-1] != e.Row.TransactionID) {
				xids = append(xids, e.Row.TransactionID)
			}
		}
	}
	return xids
}

// walRows are the outbox rows of b, in commit order: the outbox table's
// inserts, and the rows the logical messages of outbox.mode: wal_messages
// carry (Offset 0). A message that carries none is passed on as a row
// whose payload is the message's content: unwrap quarantines it.
func walRows(b wal.Batch) []store.OutboxRow {
	var rows []store.OutboxRow
	for _, t := range b.Transactions {
		for _, e := range t.Events {
			switch {
			case e.Row != nil:
				r := e.Row
				rows = append(rows, store.OutboxRow{Offset: r.Offset, UUID: r.UUID, Payload: r.Payload, Metadata: r.Metadata})
			case e.Message != nil:
				r, err := store.DecodeMessage(e.Message.Content)
				if err != nil {
					r = store.OutboxRow{Payload: e.Message.Content}
				}
				rows = append(rows, r)
			}
		}
	}
	return rows
}

// publishWAL publishes rows and returns them, those the broker refused for
// good marked for the quarantine. With relay.shards: N above 1 it splits
// them into N lanes by a hash of the aggregate id and publishes the lanes
// at once, each in commit order: events of one aggregate stay in one lane,
// in order, and the batch is done only once every lane is, so the next
// batch never overtakes it.
func (f *Forwarder) publishWAL(ctx context.Context, rows []outboxRow) ([]outboxRow, error) {
	lanes := f.walLanes()
	if len(lanes) == 0 {
		return rows, f.publishInOrder(ctx, rows)
	}
	byLane := make([][]outboxRow, len(lanes))
	for _, r := range rows {
		i := laneOf(r, len(lanes))
		byLane[i] = append(byLane[i], r)
	}
	errs := make([]error, len(lanes))
	var wg sync.WaitGroup
	for i, lane := range byLane {
		if len(lane) > 0 {
			wg.Go(func() { errs[i] = lanes[i].publishInOrder(ctx, lane) })
		}
	}
	wg.Wait()
	return slices.Concat(byLane...), errors.Join(errs...)
}

// walLanes are the relay's publishing lanes, made at the first batch: one
// relay per shard sharing f's broker, limiter, health, metrics and test
// hooks, each with its own provisioned topics. None with relay.shards: 1.
func (f *Forwarder) walLanes() []*Forwarder {
	if n := *f.cfg.Shards; n > 1 && f.wal.lanes == nil {
		f.wal.lanes = make([]*Forwarder, n)
		for i := range n {
			f.wal.lanes[i] = f.shardRelay(i)
		}
	}
	return f.wal.lanes
}

// laneOf is the lane of r among n, by a hash of its aggregate id; lane 0
// for a row without one, or unreadable.
func laneOf(r outboxRow, n int) int {
	if r.out.Msg == nil {
		return 0
	}
	agg := r.out.Msg.Metadata.Get(envelope.AggregateIDKey)
	if agg == "" {
		return 0
	}
	return int(hashOf(agg) % uint32(n))
}

// publishInOrder publishes rows in their order, marking those the broker
// refuses for good for the quarantine, and retries a retryable failure
// with backoff from the first row not confirmed, until every row is done
// or ctx ends.
func (f *Forwarder) publishInOrder(ctx context.Context, rows []outboxRow) error {
	retry := f.newBackoff()
	for done := 0; done < len(rows); {
		n, err := f.publish(ctx, rows[done:])
		done += n
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return err
		}
		f.metrics.publishErrors.WithLabelValues(errorClassRetryable).Inc()
		wait := retry.NextBackOff()
		f.logger.Error("Relay batch failed; backing off", err, watermill.LogFields{"retry_in": wait.String()})
		if !sleep.For(ctx, wait) {
			return err
		}
		f.health.beat()
	}
	return nil
}

// finishWAL deletes the published rows from the outbox and moves those
// marked for the quarantine aside, in one transaction; a row gone already
// (delivered again after a restart) is not quarantined twice.
func (f *Forwarder) finishWAL(ctx context.Context, rows []outboxRow) error {
	if len(rows) == 0 {
		return nil
	}
	offsets := make([]int64, 0, len(rows))
	refused := false
	for _, r := range rows {
		if r.row.Offset > 0 { // 0: a logical message, in no table
			offsets = append(offsets, r.row.Offset)
		}
		refused = refused || r.quarantine != ""
	}
	if len(offsets) == 0 && !refused {
		// Logical messages only (outbox.mode: wal_messages), all published:
		// no transaction, which was 13% of the relay's CPU in a drain.
		f.recordBatch(rows)
		return nil
	}
	var quarantined []outboxRow
	err := f.inAck(ctx, func(ctx context.Context, tx *sql.Tx) error {
		present, err := f.tables.DeleteRelayed(ctx, tx, offsets)
		if err != nil {
			return err
		}
		for _, r := range rows {
			// A message delivered again after a restart is quarantined again:
			// unlike a row, nothing tells that it was.
			if r.quarantine != "" && (r.row.Offset == 0 || present[r.row.Offset]) {
				if err := f.quarantineRow(ctx, tx, r); err != nil {
					return err
				}
				quarantined = append(quarantined, r)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, r := range quarantined {
		f.reportQuarantined(r)
	}
	f.recordBatch(rows)
	return nil
}
