package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// SagasTable is the qualified table of saga instances: one row per saga
// type and correlation id, with its state and version.
func (t Tables) SagasTable() string { return t.qualify("millrace_sagas") }

// SagaErrorsTable is the qualified table of the last error of each saga
// instance's steps. It is written outside the step's transaction (which
// rolls back when the step fails), and no step's transaction touches it, so
// that recording an error can never wait for a lock a batch holds.
func (t Tables) SagaErrorsTable() string { return t.qualify("millrace_saga_errors") }

// Row is what a single-row query returns: a *sql.Row or a pgx.Row.
type Row interface {
	Scan(dest ...any) error
}

// RowQuerier runs a query that returns at most one row: a transaction of
// database/sql or pgx, adapted (with sql.ErrNoRows for no row).
type RowQuerier interface {
	QueryRow(ctx context.Context, query string, args ...any) Row
}

// SagaRow is one saga instance.
type SagaRow struct {
	Type, ID string
	// State is the saga's state, JSON.
	State []byte
	// Version counts the saved changes; 0 for an instance not saved yet.
	Version int64
	// Step is the step that last moved the saga on (its event type).
	Step string
	// Timeouts maps a pending timeout's name to its scheduled event id.
	Timeouts map[string]string
	// Completed is when the saga completed; zero while it runs.
	Completed            time.Time
	CreatedAt, UpdatedAt time.Time
}

// ErrSagaVersionConflict is SaveSaga's answer when the instance changed
// since it was loaded (or was created by someone else meanwhile).
var ErrSagaVersionConflict = errors.New("saga instance changed since it was loaded")

// LoadSaga reads the saga instance (sagaType, id) in tx; found is false
// when there is none.
func (t Tables) LoadSaga(ctx context.Context, tx RowQuerier, sagaType, id string) (row SagaRow, found bool, err error) {
	var timeouts []byte
	var completed sql.NullTime
	err = tx.QueryRow(ctx, `SELECT state::text, version, step, timeouts::text, completed_at, created_at, updated_at FROM `+t.SagasTable()+`
		WHERE saga_type = $1 AND saga_id = $2`, sagaType, id).Scan(&row.State, &row.Version, &row.Step, &timeouts, &completed, &row.CreatedAt, &row.UpdatedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return SagaRow{Type: sagaType, ID: id}, false, nil
	}
	if err != nil {
		return SagaRow{}, false, fmt.Errorf("load saga %s %q: %w", sagaType, id, err)
	}
	row.Type, row.ID, row.Completed = sagaType, id, completed.Time
	if err := json.Unmarshal(timeouts, &row.Timeouts); err != nil {
		return SagaRow{}, false, fmt.Errorf("load saga %s %q: timeouts: %w", sagaType, id, err)
	}
	return row, true, nil
}

// SaveSaga writes row in tx: inserts it when row.Version is 0, else
// updates it where its version is still row.Version, and increments the
// version. ErrSagaVersionConflict means another transaction saved (or
// created) the instance first: load it again and redo the step.
func (t Tables) SaveSaga(ctx context.Context, tx Execer, row SagaRow, completed bool) error {
	timeouts, err := json.Marshal(row.Timeouts)
	if err != nil {
		return err
	}
	if row.Timeouts == nil {
		timeouts = []byte(`{}`)
	}
	var res sql.Result
	if row.Version == 0 {
		res, err = tx.ExecContext(ctx, `INSERT INTO `+t.SagasTable()+` (saga_type, saga_id, state, version, step, timeouts, completed_at)
			VALUES ($1, $2, $3::jsonb, 1, $4, $5::jsonb, CASE WHEN $6 THEN now() END) ON CONFLICT DO NOTHING`,
			row.Type, row.ID, string(row.State), row.Step, string(timeouts), completed)
	} else {
		res, err = tx.ExecContext(ctx, `UPDATE `+t.SagasTable()+` SET state = $3::jsonb, version = version + 1, step = $4,
			timeouts = $5::jsonb, updated_at = now(), completed_at = CASE WHEN $6 THEN coalesce(completed_at, now()) END
			WHERE saga_type = $1 AND saga_id = $2 AND version = $7`,
			row.Type, row.ID, string(row.State), row.Step, string(timeouts), completed, row.Version)
	}
	if err != nil {
		return fmt.Errorf("save saga %s %q: %w", row.Type, row.ID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return err
	}
	if n == 0 {
		return fmt.Errorf("save saga %s %q at version %d: %w", row.Type, row.ID, row.Version, ErrSagaVersionConflict)
	}
	return nil
}

// ListSagas returns up to limit saga instances of sagaType (every type
// when ""), the most recently changed first; running only unless
// withCompleted.
func (t Tables) ListSagas(ctx context.Context, db DBTX, sagaType string, withCompleted bool, limit int) ([]SagaRow, error) {
	rows, err := db.QueryContext(ctx, `SELECT saga_type, saga_id, state::text, version, step, timeouts::text, completed_at, created_at, updated_at
		FROM `+t.SagasTable()+` WHERE ($1 = '' OR saga_type = $1) AND ($2 OR completed_at IS NULL)
		ORDER BY updated_at DESC, saga_type, saga_id LIMIT $3`, sagaType, withCompleted, sql.NullInt64{Int64: int64(limit), Valid: limit >= 0})
	return collect(rows, err, "list "+t.SagasTable(), func(rows *sql.Rows, r *SagaRow) error {
		var timeouts []byte
		var completed sql.NullTime
		if err := rows.Scan(&r.Type, &r.ID, &r.State, &r.Version, &r.Step, &timeouts, &completed, &r.CreatedAt, &r.UpdatedAt); err != nil {
			return err
		}
		r.Completed = completed.Time
		if err := json.Unmarshal(timeouts, &r.Timeouts); err != nil {
			return fmt.Errorf("timeouts of %s %q: %w", r.Type, r.ID, err)
		}
		return nil
	})
}

// DeleteCompletedSagas deletes up to limit sagas of sagaType that completed
// more than olderThan ago, and returns how many.
func (t Tables) DeleteCompletedSagas(ctx context.Context, db Execer, sagaType string, olderThan time.Duration, limit int) (int64, error) {
	res, err := db.ExecContext(ctx, `DELETE FROM `+t.SagasTable()+` WHERE ctid = ANY(ARRAY(
		SELECT ctid FROM `+t.SagasTable()+` WHERE saga_type = $1 AND completed_at < now() - make_interval(secs => $2)
		LIMIT $3 FOR UPDATE SKIP LOCKED))`, sagaType, olderThan.Seconds(), limit)
	if err != nil {
		return 0, fmt.Errorf("delete completed sagas of %s: %w", sagaType, err)
	}
	return res.RowsAffected()
}

// SagaError is the last error of a saga instance's steps.
type SagaError struct {
	// Step is the event type of the step that failed.
	Step string
	// Message is the error's text.
	Message string
	// FailedAt is when it failed.
	FailedAt time.Time
}

// RecordSagaError stores e as the last error of the saga instance
// (sagaType, id), unless a later one is stored already.
func (t Tables) RecordSagaError(ctx context.Context, db Execer, sagaType, id string, e SagaError) error {
	_, err := db.ExecContext(ctx, `INSERT INTO `+t.SagaErrorsTable()+` AS e (saga_type, saga_id, step, error, failed_at)
		VALUES ($1, $2, $3, $4, $5) ON CONFLICT (saga_type, saga_id) DO UPDATE
		SET step = excluded.step, error = excluded.error, failed_at = excluded.failed_at WHERE e.failed_at <= excluded.failed_at`,
		sagaType, id, e.Step, e.Message, e.FailedAt)
	if err != nil {
		return fmt.Errorf("record the error of saga %s %q: %w", sagaType, id, err)
	}
	return nil
}

// LoadSagaError reads the last error of the saga instance (sagaType, id);
// found is false when none is stored.
func (t Tables) LoadSagaError(ctx context.Context, db RowQuerier, sagaType, id string) (e SagaError, found bool, err error) {
	err = db.QueryRow(ctx, `SELECT step, error, failed_at FROM `+t.SagaErrorsTable()+` WHERE saga_type = $1 AND saga_id = $2`,
		sagaType, id).Scan(&e.Step, &e.Message, &e.FailedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return SagaError{}, false, nil
	}
	if err != nil {
		return SagaError{}, false, fmt.Errorf("load the error of saga %s %q: %w", sagaType, id, err)
	}
	return e, true, nil
}

// DeleteSagaErrors deletes the stored errors of sagaType older than
// olderThan (a saga's retention) and returns how many.
func (t Tables) DeleteSagaErrors(ctx context.Context, db Execer, sagaType string, olderThan time.Duration) (int64, error) {
	res, err := db.ExecContext(ctx, `DELETE FROM `+t.SagaErrorsTable()+` WHERE saga_type = $1 AND failed_at < now() - make_interval(secs => $2)`,
		sagaType, olderThan.Seconds())
	if err != nil {
		return 0, fmt.Errorf("delete saga errors of %s: %w", sagaType, err)
	}
	return res.RowsAffected()
}

func (t Tables) sagaStatements() []string {
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t.SagasTable() + ` (
	saga_type TEXT NOT NULL,
	saga_id TEXT NOT NULL,
	state JSONB NOT NULL,
	version BIGINT NOT NULL,
	step TEXT NOT NULL,
	timeouts JSONB NOT NULL DEFAULT '{}',
	created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
	completed_at TIMESTAMPTZ,
	PRIMARY KEY (saga_type, saga_id)
)`,
		t.index("millrace_sagas_completed_at", t.SagasTable(), `(saga_type, completed_at) WHERE completed_at IS NOT NULL`),
		`CREATE TABLE IF NOT EXISTS ` + t.SagaErrorsTable() + ` (
	saga_type TEXT NOT NULL,
	saga_id TEXT NOT NULL,
	step TEXT NOT NULL,
	error TEXT NOT NULL,
	failed_at TIMESTAMPTZ NOT NULL,
	PRIMARY KEY (saga_type, saga_id)
)`,
	}
}
