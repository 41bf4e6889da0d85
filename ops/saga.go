package ops

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/millrace-io/millrace/internal/store"
)

// SagaInstance is one saga instance as the operations API shows it.
type SagaInstance struct {
	// Saga is the saga type's name (NewSaga).
	Saga string `json:"saga"`
	// ID is the instance's correlation id.
	ID string `json:"id"`
	// Step is the event type of the step that last moved it on.
	Step string `json:"step"`
	// Version counts its saved changes.
	Version int64 `json:"version"`
	// State is its state, as JSON.
	State json.RawMessage `json:"state"`
	// Timeouts are its pending timeouts: name and scheduled event id.
	Timeouts map[string]string `json:"timeouts"`
	// CompletedAt is when it completed; nil while it runs.
	CompletedAt *time.Time `json:"completed_at"`
	CreatedAt   time.Time  `json:"created_at"` // when its starting step committed
	UpdatedAt   time.Time  `json:"updated_at"` // when its last step committed
	// LastError is the last error of its steps, kept for the saga's
	// retention; nil when no step failed (shown by Saga, not ListSagas).
	LastError *SagaStepError `json:"last_error,omitempty"`
}

// SagaStepError is a failed attempt of a saga step. The attempt rolled back
// (nothing of it was kept) and its event went the retry or poison way.
type SagaStepError struct {
	// Step is the event type of the step that failed.
	Step string `json:"step"`
	// Error is the step's error.
	Error string `json:"error"`
	// FailedAt is when it failed.
	FailedAt time.Time `json:"failed_at"`
	// Current is true when no step of the instance committed since: the
	// saga has not moved on from it. A starting step that failed leaves an
	// instance with Version 0 and Current true.
	Current bool `json:"current"`
}

// SagaFilter selects saga instances.
type SagaFilter struct {
	// Saga is a saga type's name; "" selects every type.
	Saga string
	// Completed includes completed instances (kept for their retention).
	Completed bool
}

// SagaList is a page of saga instances.
type SagaList struct {
	Instances []SagaInstance `json:"instances"` // the instances of the page
	// Truncated says more instances match than the limit.
	Truncated bool `json:"truncated"`
}

func sagaInstance(r store.SagaRow) SagaInstance {
	inst := SagaInstance{Saga: r.Type, ID: r.ID, Step: r.Step, Version: r.Version, State: json.RawMessage(r.State),
		Timeouts: r.Timeouts, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}
	if inst.Timeouts == nil {
		inst.Timeouts = map[string]string{}
	}
	if !r.Completed.IsZero() {
		at := r.Completed
		inst.CompletedAt = &at
	}
	return inst
}

// ListSagas lists the saga instances f selects, the most recently changed
// first, at most limit of them (0: all).
func (c *Client) ListSagas(ctx context.Context, f SagaFilter, limit int) (SagaList, error) {
	read, err := listLimit(limit)
	if err != nil {
		return SagaList{}, err
	}
	if read == 0 {
		read = -1
	}
	rows, err := c.tables.ListSagas(ctx, c.db, f.Saga, f.Completed, read)
	if err != nil {
		return SagaList{}, err
	}
	var res SagaList
	res.Instances, res.Truncated = page(rows, sagaInstance, limit)
	return res, nil
}

// Saga returns the instance id of saga type saga, running or completed,
// with its steps' last error; an instance whose starting step failed and
// never committed is returned with Version 0 and that error. Otherwise the
// error matches ErrNotFound.
func (c *Client) Saga(ctx context.Context, saga, id string) (SagaInstance, error) {
	row, found, err := c.tables.LoadSaga(ctx, store.SQLRowQuerier{DB: c.db}, saga, id)
	if err != nil {
		return SagaInstance{}, err
	}
	stepErr, failed, err := c.tables.LoadSagaError(ctx, store.SQLRowQuerier{DB: c.db}, saga, id)
	if err != nil {
		return SagaInstance{}, err
	}
	if !found && !failed {
		return SagaInstance{}, fmt.Errorf("%w: saga %s instance %q", ErrNotFound, saga, id)
	}
	inst := sagaInstance(row)
	if failed {
		inst.LastError = &SagaStepError{Step: stepErr.Step, Error: stepErr.Message, FailedAt: stepErr.FailedAt,
			Current: !found || !stepErr.FailedAt.Before(row.UpdatedAt)}
	}
	return inst, nil
}
