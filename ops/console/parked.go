package console

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"github.com/millrace-io/millrace/ops"
)

// parkedKeys are the parked aggregates page's filter keys.
var parkedKeys = []string{"group", "handler", "key", "state", "limit"}

// parkedData is the parked aggregates page's.
type parkedData struct {
	Filter    ops.ParkedFilter
	Parks     []ops.ParkedAggregate
	Truncated bool
}

// parkedList lists the aggregates ordered handlers hold parked behind a
// poisoned message; each links to that message, whose replay releases it.
func (c *Console) parkedList(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	err := checkKeys(q, parkedKeys, nil)
	limit := defaultLimit
	if err == nil {
		limit, err = parseLimit(strings.TrimSpace(q.Get("limit")))
	}
	f := ops.ParkedFilter{Group: strings.TrimSpace(q.Get("group")), Handler: strings.TrimSpace(q.Get("handler")),
		Key: q.Get("key"), State: strings.TrimSpace(q.Get("state"))}
	var list ops.List[ops.ParkedAggregate]
	if err == nil {
		list, err = c.ops.Parked(r.Context(), f, limit)
	}
	if errors.Is(err, ops.ErrInvalidFilter) {
		err = badf("state %q: want %s or %s", f.State, ops.ParkStateHeld, ops.ParkStateDraining)
	}
	if err != nil {
		c.failErr(w, r, err)
		return
	}
	c.render(w, r, "parked", page{Title: "Parked aggregates", Nav: "parked",
		Data: parkedData{Filter: f, Parks: list.Rows, Truncated: list.Truncated}})
}

// skipAction skips the selected rows of t (the DLQ's; the quarantine's
// Skip is ops.ErrNotSupported) into d, each row shown by row.
func skipAction[R, D, E, S any](ctx context.Context, t ops.Table[R, D, E, S], d *actionData, dryRun bool, row func(R) row) error {
	res, err := t.Skip(ctx, d.Selection.ops(), dryRun)
	if err != nil {
		return err
	}
	d.Token, d.Count, d.Released = res.Selection, len(res.Skipped), res.Released
	for _, m := range res.Skipped {
		d.Rows = append(d.Rows, row(m))
	}
	return nil
}
