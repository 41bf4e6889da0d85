package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/pgschema"
)

// States of a poisoned message, derived from its row and the inbox.
const (
	statePoisoned  = "poisoned"  // waiting: not replayed since it was last poisoned
	stateReplayed  = "replayed"  // sent back through the outbox, not (yet) processed
	stateProcessed = "processed" // its consumer group's inbox records the event id
)

// poisonRow is one message of the poison table (millrace_poison) as the dlq
// commands report it.
type poisonRow struct {
	ID             int64      `json:"id"`
	ConsumerGroup  string     `json:"consumer_group"`
	Handler        string     `json:"handler"`
	Topic          string     `json:"topic"`
	MessageID      string     `json:"message_id"`
	EventID        string     `json:"event_id"`
	EventType      string     `json:"event_type"`
	State          string     `json:"state"`
	ErrorClass     string     `json:"error_class"`
	Reason         string     `json:"reason"`
	Attempts       int        `json:"attempts"`
	TimesPoisoned  int        `json:"times_poisoned"`
	FirstFailureAt time.Time  `json:"first_failure_at"`
	LastFailureAt  time.Time  `json:"last_failure_at"`
	PoisonedAt     time.Time  `json:"poisoned_at"`
	ReplayedAt     *time.Time `json:"replayed_at"`
	ReplayCount    int        `json:"replay_count"`
	ProcessedAt    *time.Time `json:"processed_at"`
	PayloadBytes   int        `json:"payload_bytes"`

	// Read with poisonQuery.full only.
	traceparent string
	payload     []byte
	metadata    map[string]string
}

type queryer interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// poisonQuery reads poison rows, each with its replay count and the time its
// consumer group's inbox recorded the event (if it did).
type poisonQuery struct {
	where []string
	args  []any
	order string // SQL ORDER BY
	limit int    // 0: no limit
	full  bool   // also payload, metadata and traceparent
	lock  bool   // FOR UPDATE of the poison rows
}

func (q poisonQuery) run(ctx context.Context, db queryer, t pgschema.Tables) ([]poisonRow, error) {
	cols := `p.id, p.consumer_group, p.handler, p.source_topic, p.message_id, p.event_id, p.event_type,
	p.error_class, p.reason, p.attempts, p.times_poisoned, p.first_failure_at, p.last_failure_at,
	p.poisoned_at, p.replayed_at, (SELECT count(*) FROM ` + t.PoisonReplays() + ` r WHERE r.poison_id = p.id),
	i.processed_at, length(p.payload)`
	if q.full {
		cols += `, p.traceparent, p.payload, p.metadata`
	}
	var b strings.Builder
	b.WriteString(`SELECT ` + cols + ` FROM ` + t.Poison() + ` p
	LEFT JOIN ` + t.Inbox() + ` i ON i.consumer_group = p.consumer_group AND i.event_id = p.event_id`)
	if len(q.where) > 0 {
		b.WriteString("\nWHERE " + strings.Join(q.where, " AND "))
	}
	b.WriteString("\nORDER BY " + q.order)
	if q.limit > 0 {
		b.WriteString(" LIMIT " + strconv.Itoa(q.limit))
	}
	if q.lock {
		b.WriteString(" FOR UPDATE OF p")
	}
	rows, err := db.QueryContext(ctx, b.String(), q.args...)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", t.Poison(), err)
	}
	defer rows.Close()
	var out []poisonRow
	for rows.Next() {
		var r poisonRow
		var replayed, processed sql.NullTime
		var metadata []byte
		dest := []any{&r.ID, &r.ConsumerGroup, &r.Handler, &r.Topic, &r.MessageID, &r.EventID, &r.EventType,
			&r.ErrorClass, &r.Reason, &r.Attempts, &r.TimesPoisoned, &r.FirstFailureAt, &r.LastFailureAt,
			&r.PoisonedAt, &replayed, &r.ReplayCount, &processed, &r.PayloadBytes}
		if q.full {
			dest = append(dest, &r.traceparent, &r.payload, &metadata)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, fmt.Errorf("read %s: %w", t.Poison(), err)
		}
		if q.full {
			if err := json.Unmarshal(metadata, &r.metadata); err != nil {
				return nil, fmt.Errorf("poison message %d: metadata is not a JSON object of strings: %w", r.ID, err)
			}
		}
		r.FirstFailureAt, r.LastFailureAt, r.PoisonedAt = r.FirstFailureAt.UTC(), r.LastFailureAt.UTC(), r.PoisonedAt.UTC()
		r.ReplayedAt, r.ProcessedAt = utcPtr(replayed), utcPtr(processed)
		switch {
		case r.ProcessedAt != nil:
			r.State = stateProcessed
		case r.ReplayedAt != nil:
			r.State = stateReplayed
		default:
			r.State = statePoisoned
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", t.Poison(), err)
	}
	return out, nil
}

func utcPtr(t sql.NullTime) *time.Time {
	if !t.Valid {
		return nil
	}
	u := t.Time.UTC()
	return &u
}

// missingIDs returns the ids that rows lacks.
func missingIDs(ids []int64, rows []poisonRow) []int64 {
	found := make(map[int64]bool, len(rows))
	for _, r := range rows {
		found[r.ID] = true
	}
	var missing []int64
	for _, id := range ids {
		if !found[id] {
			missing = append(missing, id)
		}
	}
	return missing
}

func notFound(missing []int64) error {
	s := make([]string, len(missing))
	for i, id := range missing {
		s[i] = strconv.FormatInt(id, 10)
	}
	if len(s) == 1 {
		return fmt.Errorf("no poisoned message with id %s", s[0])
	}
	return fmt.Errorf("no poisoned messages with ids %s", strings.Join(s, ", "))
}

// openDB connects to database.url and checks that the given tables exist, so
// that a database that is down or not migrated gets a clear error.
func openDB(ctx context.Context, cfg bus.Config, tables ...string) (*sql.DB, error) {
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, cfg.Database.ConnectTimeout)
	defer cancel()
	for _, table := range tables {
		var exists bool
		if err := db.QueryRowContext(cctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
			db.Close()
			return nil, fmt.Errorf("database %s not reachable within database.connect_timeout (%s): %w",
				redactedURL(cfg.Database.URL), cfg.Database.ConnectTimeout, err)
		}
		if !exists {
			db.Close()
			return nil, fmt.Errorf("table %s does not exist: run `millrace migrate` first", table)
		}
	}
	return db, nil
}

// redactedURL is raw without its password (the stderr writer also hides a
// password given as a query parameter).
func redactedURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparseable URL>"
	}
	return u.Redacted()
}

func tablesOf(cfg bus.Config) pgschema.Tables {
	return pgschema.Tables{Schema: cfg.Database.Schema, OutboxTopic: cfg.Outbox.Topic}
}

// timeText formats t for text output.
func timeText(t *time.Time, none string) string {
	if t == nil {
		return none
	}
	return t.Format(time.RFC3339)
}
