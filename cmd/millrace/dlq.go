package main

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/pgschema"
	"github.com/millrace-io/millrace/middleware"
)

func init() {
	commands = append(commands,
		command{path: "dlq list", summary: "list poisoned messages, newest first, with their failure reason and state", bind: bindList},
		command{path: "dlq show", args: "ID", summary: "one poisoned message: failure envelope, metadata, payload, replay history", bind: bindShow},
		command{path: "dlq replay", args: "[ID...]", summary: "send poisoned messages back to their topic through the outbox (same event id: the inbox keeps the effect single)", bind: bindReplay},
		command{path: "dlq purge", args: "[ID...]", summary: "delete poisoned messages and their replay history", bind: bindPurge},
	)
}

// listResult is the --json output of dlq list.
type listResult struct {
	Messages  []poisonRow `json:"messages"`
	Truncated bool        `json:"truncated"` // more messages match than --limit
}

func bindList(fs *flag.FlagSet) runFunc {
	var f filter
	f.register(fs, 100, "show at most `N` messages (0: no limit)")
	return func(ctx context.Context, e env, args []string) error {
		if err := noArgs(args); err != nil {
			return err
		}
		if err := f.check(); err != nil {
			return err
		}
		t := tablesOf(e.cfg)
		db, err := openDB(ctx, e.cfg, t.Poison(), t.PoisonReplays(), t.Inbox())
		if err != nil {
			return err
		}
		defer db.Close()
		q := poisonQuery{order: "p.poisoned_at DESC, p.id DESC"}
		q.where = f.where(&q.args)
		if f.limit > 0 {
			q.limit = f.limit + 1
		}
		rows, err := q.run(ctx, db, t)
		if err != nil {
			return err
		}
		res := listResult{Messages: nonNil(rows)}
		if f.limit > 0 && len(rows) > f.limit {
			res.Messages, res.Truncated = rows[:f.limit], true
		}
		return e.print(res, func(w io.Writer) {
			if len(res.Messages) == 0 {
				fmt.Fprintln(w, "no poisoned messages match")
				return
			}
			writeTable(w, res.Messages)
			if res.Truncated {
				fmt.Fprintf(w, "(more messages match; showing %d, raise --limit to see more)\n", f.limit)
			}
		})
	}
}

// writeTable writes rows as the text table of dlq list and dlq purge.
func writeTable(w io.Writer, rows []poisonRow) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tPOISONED AT\tGROUP\tHANDLER\tTOPIC\tEVENT TYPE\tCLASS\tTIMES\tSTATE\tREASON")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", r.ID, r.PoisonedAt.Format(time.RFC3339),
			r.ConsumerGroup, r.Handler, r.Topic, cell(r.EventType, 30), r.ErrorClass, r.TimesPoisoned, r.State, cell(r.Reason, 60))
	}
	tw.Flush()
}

// cell shortens s to its first line and at most n characters, for a table.
func cell(s string, n int) string {
	s, _, cut := strings.Cut(s, "\n")
	s = strings.ReplaceAll(s, "\t", " ")
	if utf8.RuneCountInString(s) > n {
		s, cut = string([]rune(s)[:n-1]), true
	}
	if cut {
		s += "…"
	}
	if s == "" {
		s = "-"
	}
	return s
}

// showResult is the --json output of dlq show: the list fields plus these.
type showResult struct {
	poisonRow
	Traceparent string            `json:"traceparent"`
	Metadata    map[string]string `json:"metadata"`
	Payload     payloadView       `json:"payload"`
	Replays     []replayRecord    `json:"replays"`
}

// payloadView is a payload as JSON (encoding "json", value the JSON itself) or
// as text (encoding "base64" or "hex", value a string).
type payloadView struct {
	Bytes    int    `json:"bytes"`
	Encoding string `json:"encoding"`
	Value    any    `json:"value"`
}

// replayRecord is one replay of a poisoned message.
type replayRecord struct {
	ReplayedAt    time.Time `json:"replayed_at"`
	MessageID     string    `json:"message_id"`     // the message id the replay was sent with
	ReplayedBy    string    `json:"replayed_by"`    // user@host that ran the replay
	TimesPoisoned int       `json:"times_poisoned"` // the row's times_poisoned when it was replayed
}

func bindShow(fs *flag.FlagSet) runFunc {
	asHex := fs.Bool("hex", false, "show a payload that is not JSON in hex instead of base64")
	return func(ctx context.Context, e env, args []string) error {
		if len(args) != 1 {
			return usagef("want exactly one message ID; got %d arguments", len(args))
		}
		id, err := strconv.ParseInt(args[0], 10, 64)
		if err != nil || id <= 0 {
			return usagef("%q is not a poison message ID (a positive integer, as `millrace dlq list` shows)", args[0])
		}
		t := tablesOf(e.cfg)
		db, err := openDB(ctx, e.cfg, t.Poison(), t.PoisonReplays(), t.Inbox())
		if err != nil {
			return err
		}
		defer db.Close()
		rows, err := poisonQuery{where: []string{"p.id = $1"}, args: []any{id}, order: "p.id", full: true}.run(ctx, db, t)
		if err != nil {
			return err
		}
		if len(rows) == 0 {
			return notFound([]int64{id})
		}
		r := rows[0]
		replays, err := replaysOf(ctx, db, t, id)
		if err != nil {
			return err
		}
		res := showResult{poisonRow: r, Traceparent: r.traceparent, Metadata: r.metadata, Replays: replays,
			Payload: viewPayload(r.payload, *asHex)}
		return e.print(res, func(w io.Writer) { writeShow(w, res) })
	}
}

func replaysOf(ctx context.Context, db *sql.DB, t pgschema.Tables, id int64) ([]replayRecord, error) {
	rows, err := db.QueryContext(ctx, `SELECT replayed_at, message_id, replayed_by, times_poisoned FROM `+
		t.PoisonReplays()+` WHERE poison_id = $1 ORDER BY id`, id)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", t.PoisonReplays(), err)
	}
	defer rows.Close()
	out := []replayRecord{}
	for rows.Next() {
		var r replayRecord
		if err := rows.Scan(&r.ReplayedAt, &r.MessageID, &r.ReplayedBy, &r.TimesPoisoned); err != nil {
			return nil, fmt.Errorf("read %s: %w", t.PoisonReplays(), err)
		}
		r.ReplayedAt = r.ReplayedAt.UTC()
		out = append(out, r)
	}
	return out, rows.Err()
}

func viewPayload(p []byte, asHex bool) payloadView {
	switch {
	case len(p) > 0 && json.Valid(p):
		return payloadView{Bytes: len(p), Encoding: "json", Value: json.RawMessage(p)}
	case asHex:
		return payloadView{Bytes: len(p), Encoding: "hex", Value: hex.EncodeToString(p)}
	default:
		return payloadView{Bytes: len(p), Encoding: "base64", Value: base64.StdEncoding.EncodeToString(p)}
	}
}

func writeShow(w io.Writer, r showResult) {
	field := func(name string, value any) { fmt.Fprintf(w, "%-16s %v\n", name+":", value) }
	field("id", r.ID)
	field("state", r.State)
	field("consumer group", r.ConsumerGroup)
	field("handler", r.Handler)
	field("topic", r.Topic)
	field("event type", r.EventType)
	field("event id", r.EventID)
	field("message id", r.MessageID)
	field("error class", r.ErrorClass)
	field("attempts", fmt.Sprintf("%d (in its last delivery)", r.Attempts))
	field("times poisoned", r.TimesPoisoned)
	field("first failure", r.FirstFailureAt.Format(time.RFC3339Nano))
	field("last failure", r.LastFailureAt.Format(time.RFC3339Nano))
	field("poisoned at", r.PoisonedAt.Format(time.RFC3339Nano))
	field("traceparent", cmp.Or(r.Traceparent, "-"))
	field("replayed at", timeText(r.ReplayedAt, "not since it was last poisoned"))
	field("processed at", timeText(r.ProcessedAt, "not recorded in the consumer group's inbox"))
	fmt.Fprintln(w, "reason:")
	writeIndented(w, r.Reason)
	fmt.Fprintln(w, "metadata:")
	if len(r.Metadata) == 0 {
		fmt.Fprintln(w, "  (none)")
	}
	for _, k := range slices.Sorted(maps.Keys(r.Metadata)) {
		fmt.Fprintf(w, "  %s: %s\n", k, r.Metadata[k])
	}
	switch r.Payload.Encoding {
	case "json":
		fmt.Fprintf(w, "payload (%d bytes, JSON):\n", r.Payload.Bytes)
		var pretty bytes.Buffer
		raw := r.Payload.Value.(json.RawMessage)
		if err := json.Indent(&pretty, raw, "", "  "); err != nil {
			pretty.Reset()
			pretty.Write(raw)
		}
		writeIndented(w, pretty.String())
	case "hex":
		fmt.Fprintf(w, "payload (%d bytes, not JSON; shown as a hex dump):\n", r.Payload.Bytes)
		writeIndented(w, strings.TrimSuffix(hex.Dump(mustDecodeHex(r.Payload.Value.(string))), "\n"))
	default:
		fmt.Fprintf(w, "payload (%d bytes, not JSON; shown as base64, decode with `base64 -d`, or use --hex):\n", r.Payload.Bytes)
		writeIndented(w, r.Payload.Value.(string))
	}
	fmt.Fprintf(w, "replays (%d):\n", len(r.Replays))
	for _, rp := range r.Replays {
		fmt.Fprintf(w, "  %s by %s as message %s (after poisoning %d)\n",
			rp.ReplayedAt.Format(time.RFC3339), rp.ReplayedBy, rp.MessageID, rp.TimesPoisoned)
	}
}

func mustDecodeHex(s string) []byte {
	b, _ := hex.DecodeString(s) // produced by hex.EncodeToString above
	return b
}

func writeIndented(w io.Writer, s string) {
	for line := range strings.SplitSeq(s, "\n") {
		fmt.Fprintf(w, "  %s\n", line)
	}
}

// replayResult is the --json output of dlq replay.
type replayResult struct {
	DryRun   bool          `json:"dry_run"`
	Replayed []replayEntry `json:"replayed"`
	Skipped  []skipEntry   `json:"skipped"`
	// Messages counts the messages written to the outbox (with --dry-run:
	// that would be): one per event and topic, however many consumer groups
	// poisoned it.
	Messages int      `json:"messages"`
	Warnings []string `json:"warnings"`
}

// replayEntry is a poison row that was (or with --dry-run would be) replayed.
type replayEntry struct {
	ID            int64  `json:"id"`
	ConsumerGroup string `json:"consumer_group"`
	Handler       string `json:"handler"`
	Topic         string `json:"topic"`
	EventID       string `json:"event_id"`
	EventType     string `json:"event_type"`
	MessageID     string `json:"message_id"` // the replay's new message id; "" with --dry-run
}

// skipEntry is a selected poison row that was not replayed.
type skipEntry struct {
	ID            int64     `json:"id"`
	ConsumerGroup string    `json:"consumer_group"`
	Handler       string    `json:"handler"`
	Topic         string    `json:"topic"`
	EventID       string    `json:"event_id"`
	EventType     string    `json:"event_type"`
	Reason        string    `json:"reason"` // "already_processed"
	ProcessedAt   time.Time `json:"processed_at"`
}

const skipAlreadyProcessed = "already_processed"

func bindReplay(fs *flag.FlagSet) runFunc {
	var sel selection
	sel.register(fs)
	dryRun := fs.Bool("dry-run", false, "show what would be replayed; change nothing")
	force := fs.Bool("force", false, "also replay messages whose event the consumer group's inbox already records (the group acks them as duplicates)")
	return func(ctx context.Context, e env, args []string) error {
		if err := sel.resolve(args, "replay"); err != nil {
			return err
		}
		t := tablesOf(e.cfg)
		db, err := openDB(ctx, e.cfg, t.Poison(), t.PoisonReplays(), t.Inbox(), t.Outbox(), t.AggregateVersions())
		if err != nil {
			return err
		}
		defer db.Close()
		res, err := replay(ctx, db, e.cfg, &sel, *dryRun, *force)
		if err != nil {
			return err
		}
		if !e.asJSON {
			for _, w := range res.Warnings {
				fmt.Fprintln(e.errOut, "warning:", w)
			}
		}
		return e.print(res, func(w io.Writer) { writeReplay(w, res) })
	}
}

// replay sends the selected poison rows back through the outbox, in one
// transaction: one outbox message per (topic, event id), with a new message
// id and the original event id, payload and metadata; the rows get
// replayed_at and a history record. Rows whose consumer group's inbox
// already records the event are skipped unless force.
func replay(ctx context.Context, db *sql.DB, cfg bus.Config, sel *selection, dryRun, force bool) (replayResult, error) {
	t := tablesOf(cfg)
	res := replayResult{DryRun: dryRun, Replayed: []replayEntry{}, Skipped: []skipEntry{}, Warnings: []string{}}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return res, fmt.Errorf("begin transaction: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit

	q := poisonQuery{order: "p.id", limit: sel.limit, full: true, lock: !dryRun}
	q.where = sel.where(&q.args)
	rows, err := q.run(ctx, tx, t)
	if err != nil {
		return res, err
	}
	if missing := missingIDs(sel.ids, rows); len(missing) > 0 {
		return res, notFound(missing)
	}

	// One message per event: the broker gives it to every consumer group of
	// the topic, so several poisoned rows of one event need one message.
	type eventKey struct{ topic, eventID string }
	var order []eventKey
	byEvent := map[eventKey][]poisonRow{}
	for _, r := range rows {
		k := eventKey{r.Topic, r.EventID}
		if _, ok := byEvent[k]; !ok {
			order = append(order, k)
		}
		byEvent[k] = append(byEvent[k], r)
	}
	var outbox []*message.Message
	var ids []int64
	var messageIDs []string
	warned := map[string]bool{}
	warn := func(format string, args ...any) {
		if w := fmt.Sprintf(format, args...); !warned[w] {
			warned[w] = true
			res.Warnings = append(res.Warnings, w)
		}
	}
	for _, k := range order {
		var chosen []poisonRow
		for _, r := range byEvent[k] {
			if r.ProcessedAt != nil && !force {
				res.Skipped = append(res.Skipped, skipEntry{ID: r.ID, ConsumerGroup: r.ConsumerGroup, Handler: r.Handler,
					Topic: r.Topic, EventID: r.EventID, EventType: r.EventType, Reason: skipAlreadyProcessed, ProcessedAt: *r.ProcessedAt})
				continue
			}
			chosen = append(chosen, r)
		}
		if len(chosen) == 0 {
			continue
		}
		first := chosen[0]
		messageID := ""
		if !dryRun {
			messageID = uuid.Must(uuid.NewV7()).String()
			msg, err := replayMessage(first, messageID)
			if err != nil {
				return res, fmt.Errorf("poison message %d: %w", first.ID, err)
			}
			outbox = append(outbox, msg)
		}
		res.Messages++
		for _, r := range chosen {
			res.Replayed = append(res.Replayed, replayEntry{ID: r.ID, ConsumerGroup: r.ConsumerGroup, Handler: r.Handler,
				Topic: r.Topic, EventID: r.EventID, EventType: r.EventType, MessageID: messageID})
			ids = append(ids, r.ID)
			messageIDs = append(messageIDs, messageID)
			if !*cfg.Consumer.For(r.Handler).Inbox.Enabled {
				warn("handler %s has consumer.inbox.enabled false: nothing deduplicates its replays, so replaying a message twice processes it twice", r.Handler)
			}
			if *cfg.Consumer.For(r.Handler).OrderingGuard {
				applied, version, err := staleFor(ctx, tx, t, r)
				if err != nil {
					return res, err
				}
				if version > 0 && applied >= version {
					warn("message %d: handler %s has the ordering guard on and has applied version %d of %s %s; the event is version %d, so the group drops its replay as stale",
						r.ID, r.Handler, applied, r.metadata[envelope.AggregateTypeKey], r.metadata[envelope.AggregateIDKey], version)
				}
			}
		}
		if age := time.Since(occurredAt(first)); age > cfg.Consumer.Inbox.Retention {
			warn("event %s on topic %s is older than consumer.inbox.retention (%s): consumer groups that processed it may have pruned it from their inbox and would process it again",
				k.eventID, k.topic, cfg.Consumer.Inbox.Retention)
		}
	}
	if dryRun || len(ids) == 0 {
		return res, nil
	}

	// The outbox rows in watermill-sql's format, as bus.Publish writes them;
	// the relay delivers them like any other event.
	const rowsPerInsert = 1000 // PostgreSQL allows 65535 bind parameters, three per row
	for start := 0; start < len(outbox); start += rowsPerInsert {
		iq, err := t.SchemaAdapter().InsertQuery(t.OutboxTopic, outbox[start:min(start+rowsPerInsert, len(outbox))])
		if err != nil {
			return res, fmt.Errorf("build outbox insert: %w", err)
		}
		if _, err := tx.ExecContext(ctx, iq.Query, iq.Args...); err != nil {
			return res, fmt.Errorf("write to outbox %s: %w", t.Outbox(), err)
		}
	}
	if _, err := tx.ExecContext(ctx, `UPDATE `+t.Poison()+` SET replayed_at = now() WHERE id = ANY($1)`, ids); err != nil {
		return res, fmt.Errorf("mark replayed: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+t.PoisonReplays()+` (poison_id, message_id, replayed_by, times_poisoned)
SELECT p.id, m.message_id, $3, p.times_poisoned
FROM unnest($1::bigint[], $2::text[]) AS m(poison_id, message_id) JOIN `+t.Poison()+` p ON p.id = m.poison_id`,
		ids, messageIDs, operator()); err != nil {
		return res, fmt.Errorf("record replay history: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return res, fmt.Errorf("commit replay: %w", err)
	}
	return res, nil
}

// staleFor returns the aggregate version r's consumer group has applied to
// r's aggregate (0 if none) and r's own version (0 if it has none).
func staleFor(ctx context.Context, tx *sql.Tx, t pgschema.Tables, r poisonRow) (applied, version int64, err error) {
	version, _ = strconv.ParseInt(r.metadata[envelope.AggregateVersionKey], 10, 64)
	if version <= 0 || r.metadata[envelope.AggregateIDKey] == "" {
		return 0, 0, nil
	}
	err = tx.QueryRowContext(ctx, `SELECT version FROM `+t.AggregateVersions()+`
WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3`,
		r.ConsumerGroup, r.metadata[envelope.AggregateTypeKey], r.metadata[envelope.AggregateIDKey]).Scan(&applied)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, version, nil
	}
	if err != nil {
		return 0, 0, fmt.Errorf("read %s: %w", t.AggregateVersions(), err)
	}
	return applied, version, nil
}

// replayMessage is the outbox row that re-sends r to its topic: a new message
// id (brokers that deduplicate by message id would drop the original's), the
// original event id (the inbox key), payload and metadata, and
// middleware.ReplayOfKey naming the original message.
func replayMessage(r poisonRow, messageID string) (*message.Message, error) {
	msg := message.NewMessage(messageID, r.payload)
	msg.Metadata = make(message.Metadata, len(r.metadata)+2)
	maps.Copy(msg.Metadata, r.metadata)
	if r.EventID != "" {
		// A message from plain Watermill had only its UUID as event id.
		msg.Metadata.Set(envelope.EventIDKey, r.EventID)
	}
	msg.Metadata.Set(middleware.ReplayOfKey, r.MessageID)
	payload, err := envelope.Wrap(r.Topic, msg)
	if err != nil {
		return nil, err
	}
	return message.NewMessage(messageID, payload), nil
}

// occurredAt is when r's event happened, or when it first failed if it does
// not say.
func occurredAt(r poisonRow) time.Time {
	if t, err := time.Parse(time.RFC3339Nano, r.metadata[envelope.OccurredAtKey]); err == nil {
		return t
	}
	return r.FirstFailureAt
}

// operator names who runs the tool, for the replay history.
func operator() string {
	name := os.Getenv("USER")
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	name = cmp.Or(name, "unknown")
	if host, err := os.Hostname(); err == nil && host != "" {
		name += "@" + host
	}
	return name
}

func writeReplay(w io.Writer, res replayResult) {
	verb := "replayed"
	if res.DryRun {
		verb = "would replay"
	}
	for _, r := range res.Replayed {
		fmt.Fprintf(w, "%s %d (group %s, handler %s, topic %s, event %s)", verb, r.ID, r.ConsumerGroup, r.Handler, r.Topic, r.EventID)
		if r.MessageID != "" {
			fmt.Fprintf(w, " as message %s", r.MessageID)
		}
		fmt.Fprintln(w)
	}
	for _, s := range res.Skipped {
		fmt.Fprintf(w, "skipped %d (group %s, handler %s, topic %s, event %s): already processed, the group's inbox recorded the event at %s (--force replays it anyway)\n",
			s.ID, s.ConsumerGroup, s.Handler, s.Topic, s.EventID, s.ProcessedAt.Format(time.RFC3339))
	}
	switch {
	case len(res.Replayed) == 0 && len(res.Skipped) == 0:
		fmt.Fprintln(w, "no poisoned messages match")
	case res.DryRun:
		fmt.Fprintf(w, "dry run: %d message(s) would be written to the outbox; nothing changed\n", res.Messages)
	default:
		fmt.Fprintf(w, "%d message(s) written to the outbox; the relay delivers each to every consumer group of its topic, and groups that processed the event already ack it as a duplicate\n", res.Messages)
	}
}

// purgeResult is the --json output of dlq purge.
type purgeResult struct {
	DryRun bool        `json:"dry_run"`
	Purged []poisonRow `json:"purged"` // with --dry-run: that would be purged
}

func bindPurge(fs *flag.FlagSet) runFunc {
	var sel selection
	sel.register(fs)
	dryRun := fs.Bool("dry-run", false, "show what would be deleted; change nothing")
	return func(ctx context.Context, e env, args []string) error {
		if err := sel.resolve(args, "purge"); err != nil {
			return err
		}
		t := tablesOf(e.cfg)
		db, err := openDB(ctx, e.cfg, t.Poison(), t.PoisonReplays(), t.Inbox())
		if err != nil {
			return err
		}
		defer db.Close()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return fmt.Errorf("begin transaction: %w", err)
		}
		defer tx.Rollback() //nolint:errcheck // a no-op after Commit
		q := poisonQuery{order: "p.id", limit: sel.limit, lock: !*dryRun}
		q.where = sel.where(&q.args)
		rows, err := q.run(ctx, tx, t)
		if err != nil {
			return err
		}
		if missing := missingIDs(sel.ids, rows); len(missing) > 0 {
			return notFound(missing)
		}
		if !*dryRun && len(rows) > 0 {
			ids := make([]int64, len(rows))
			for i, r := range rows {
				ids[i] = r.ID
			}
			if _, err := tx.ExecContext(ctx, `DELETE FROM `+t.Poison()+` WHERE id = ANY($1)`, ids); err != nil {
				return fmt.Errorf("delete from %s: %w", t.Poison(), err)
			}
			if err := tx.Commit(); err != nil {
				return fmt.Errorf("commit purge: %w", err)
			}
		}
		res := purgeResult{DryRun: *dryRun, Purged: nonNil(rows)}
		return e.print(res, func(w io.Writer) {
			if len(rows) == 0 {
				fmt.Fprintln(w, "no poisoned messages match")
				return
			}
			writeTable(w, rows)
			if *dryRun {
				fmt.Fprintf(w, "dry run: %d message(s) would be purged; nothing changed\n", len(rows))
			} else {
				fmt.Fprintf(w, "purged %d message(s)\n", len(rows))
			}
		})
	}
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
