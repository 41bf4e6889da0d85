package wal

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
)

// Handler publishes a batch. It returns nil only once the broker has
// confirmed every event of b; the Reader then confirms b.LSN() to
// PostgreSQL. An error stops Run, and the batch comes again after a
// restart. It is called on one goroutine, one batch at a time, in commit
// order.
type Handler func(ctx context.Context, b Batch) error

// Reader streams an outbox's committed inserts and logical messages from a
// logical replication slot. Make one with New.
type Reader struct {
	cfg      Config
	interval time.Duration // between standby status updates
}

// New checks the requirements (see Check), creates the publication and
// the slot when they are missing, and returns a Reader of them. A slot
// PostgreSQL invalidated is ErrSlotLost.
func New(ctx context.Context, cfg Config) (*Reader, error) {
	cfg, req, _, err := prepare(ctx, cfg, ensureSlot)
	if err != nil {
		return nil, err
	}
	return &Reader{cfg: cfg, interval: req.statusInterval(cfg.StatusInterval)}, nil
}

// prepare applies cfg's defaults, checks the requirements on a connection
// to cfg.URL, creates the publication when it is missing and then runs
// slot (ensureSlot or createSlot) on that connection.
func prepare(ctx context.Context, cfg Config,
	slot func(context.Context, *pgconn.PgConn, string) (SlotStatus, error)) (Config, requirements, SlotStatus, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return cfg, requirements{}, SlotStatus{}, err
	}
	conn, err := pgconn.Connect(ctx, cfg.URL)
	if err != nil {
		return cfg, requirements{}, SlotStatus{}, fmt.Errorf("wal: connect: %w", err)
	}
	defer closeConn(conn)
	req, err := check(ctx, conn)
	if err != nil {
		return cfg, req, SlotStatus{}, err
	}
	if err := ensurePublication(ctx, conn, cfg); err != nil {
		return cfg, req, SlotStatus{}, err
	}
	s, err := slot(ctx, conn, cfg.Slot)
	return cfg, req, s, err
}

// Slot is the name of the Reader's replication slot.
func (r *Reader) Slot() string { return r.cfg.Slot }

// Run streams the slot from its confirmed LSN and calls handle with each
// batch, until ctx ends (then it returns ctx's error), handle fails or the
// connection does. Before returning it confirms what handle acknowledged.
// Only one Run may read a slot at a time: another gets ErrSlotActive.
func (r *Reader) Run(ctx context.Context, handle Handler) error {
	conn, start, err := r.startReplication(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	q := newQueue(r.cfg.MaxBatchEvents, start)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		cancel(deliver(ctx, q, handle))
	}()
	s := &stream{conn: conn, q: q, dec: newDecoder(r.cfg), interval: r.interval, confirmed: start}
	err = s.run(ctx)
	cancel(err)
	wg.Wait()
	_ = s.sendStatus() // best effort: a restart redelivers what it misses
	if cause := context.Cause(ctx); cause != nil {
		return cause
	}
	return err
}

// startReplication opens the replication connection and starts streaming
// the slot from its confirmed LSN, which it returns: the status updates
// start from it, since PostgreSQL 15 lets a lower flush position move the
// slot back.
func (r *Reader) startReplication(ctx context.Context) (*pgconn.PgConn, LSN, error) {
	pgcfg, err := pgconn.ParseConfig(r.cfg.URL)
	if err != nil {
		return nil, 0, fmt.Errorf("wal: parse Config.URL: %w", err)
	}
	pgcfg.RuntimeParams["replication"] = "database"
	conn, err := pgconn.ConnectConfig(ctx, pgcfg)
	if err != nil {
		return nil, 0, fmt.Errorf("wal: open the replication connection: %w", err)
	}
	slot, err := slotStatus(ctx, conn, r.cfg.Slot) // a replication=database connection runs SQL too
	switch {
	case errors.Is(err, ErrNoSlot):
		err = droppedError(r.cfg.Slot, err)
	case err == nil && slot.WALStatus == "lost":
		err = lostError(r.cfg.Slot, nil)
	}
	if err != nil {
		closeConn(conn)
		return nil, 0, err
	}
	args := []string{"proto_version '1'", "publication_names " + quoteLiteral(quoteIdent(r.cfg.Publication))}
	if r.cfg.MessagePrefix != "" {
		args = append(args, "messages 'true'")
	}
	// LSN 0: the server starts at the slot's confirmed_flush_lsn.
	err = pglogrepl.StartReplication(ctx, conn, r.cfg.Slot, 0,
		pglogrepl.StartReplicationOptions{Mode: pglogrepl.LogicalReplication, PluginArgs: args})
	if err != nil {
		closeConn(conn)
		return nil, 0, r.startError(err)
	}
	return conn, slot.ConfirmedFlushLSN, nil
}

// startError explains START_REPLICATION's err.
func (r *Reader) startError(err error) error {
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && strings.Contains(pgErr.Message, "can no longer get changes"):
		return lostError(r.cfg.Slot, err)
	case sqlState(err) == "55006": // object_in_use
		return fmt.Errorf("wal: %w: %q (only one may read a slot; a relay that died holds it until PostgreSQL "+
			"ends its WAL sender): %w", ErrSlotActive, r.cfg.Slot, err)
	case sqlState(err) == "42704": // undefined_object
		return droppedError(r.cfg.Slot, err)
	}
	return fmt.Errorf("wal: start replication from slot %q: %w", r.cfg.Slot, err)
}

// deliver hands the queue's batches to handle and records their
// acknowledgements, until ctx ends or handle fails.
func deliver(ctx context.Context, q *queue, handle Handler) error {
	for {
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-q.ready:
		}
		for b, ok := q.take(); ok; b, ok = q.take() {
			if err := handle(ctx, b); err != nil {
				return fmt.Errorf("wal: handler: %w", err)
			}
			q.ack(b.LSN())
		}
	}
}
