package wal

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// stream reads the replication connection: it decodes the WAL data into
// the queue and sends the standby status updates.
type stream struct {
	conn     *pgconn.PgConn
	q        *queue
	dec      *decoder
	interval time.Duration

	confirmed  LSN       // the flush position last sent
	idleLSN    LSN       // a position passed while nothing was pending
	nextStatus time.Time // when the next status update is due
}

// run reads until ctx ends or the connection fails.
func (s *stream) run(ctx context.Context) error {
	s.nextStatus = time.Now()
	for {
		if !time.Now().Before(s.nextStatus) {
			if err := s.sendStatus(); err != nil {
				return err
			}
			s.nextStatus = time.Now().Add(s.interval)
		}
		if s.q.full() {
			// The Handler is behind: read nothing, keep the heartbeats.
			if err := s.waitForSpace(ctx); err != nil {
				return err
			}
			continue
		}
		rctx, cancel := context.WithDeadline(ctx, s.nextStatus)
		msg, err := s.conn.ReceiveMessage(rctx)
		cancel()
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		if pgconn.Timeout(err) {
			continue
		}
		if err != nil {
			return fmt.Errorf("wal: receive: %w", err)
		}
		if err := s.handle(msg); err != nil {
			return err
		}
	}
}

// waitForSpace waits until the Handler took a batch, a status update is
// due or ctx ends.
func (s *stream) waitForSpace(ctx context.Context) error {
	timer := time.NewTimer(time.Until(s.nextStatus))
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-s.q.space:
	case <-timer.C:
	}
	return nil
}

// handle takes one message of the replication stream.
func (s *stream) handle(msg pgproto3.BackendMessage) error {
	switch msg := msg.(type) {
	case *pgproto3.ErrorResponse:
		return fmt.Errorf("wal: replication stream: %w", pgconn.ErrorResponseToPgError(msg))
	case *pgproto3.CopyDone:
		return fmt.Errorf("wal: the server ended the replication stream")
	case *pgproto3.CopyData:
		return s.copyData(msg.Data)
	}
	return nil
}

// copyData takes a keepalive or a piece of WAL data.
func (s *stream) copyData(data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		k, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("wal: keepalive: %w", err)
		}
		s.passed(k.ServerWALEnd)
		if k.ReplyRequested {
			s.nextStatus = time.Now()
		}
	case pglogrepl.XLogDataByteID:
		x, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("wal: WAL data: %w", err)
		}
		t, err := s.dec.decode(x.WALStart, x.WALData)
		if err != nil {
			return err
		}
		switch {
		case t == nil:
		case len(t.Events) == 0:
			s.passed(t.EndLSN) // a transaction with nothing to relay
		default:
			s.q.push(*t)
		}
	}
	return nil
}

// passed records that the stream got to lsn: when nothing received is
// pending, the slot may confirm it (everything before it was relayed or
// had nothing to relay).
func (s *stream) passed(lsn LSN) {
	if !s.dec.inTransaction() && s.q.idle() {
		s.idleLSN = max(s.idleLSN, lsn)
	}
}

// sendStatus sends a standby status update whose positions are what may
// be confirmed: never past a transaction the Handler has not acknowledged.
func (s *stream) sendStatus() error {
	s.confirmed = max(s.confirmed, s.q.ackedLSN(), s.idleLSN)
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn,
		pglogrepl.StandbyStatusUpdate{WALWritePosition: s.confirmed, WALFlushPosition: s.confirmed, WALApplyPosition: s.confirmed})
	if err != nil {
		return fmt.Errorf("wal: send standby status: %w", err)
	}
	return nil
}
