package ops

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/middleware"
)

// States of a poisoned message, derived from its row and the inbox.
const (
	// PoisonStatePoisoned: waiting, not replayed since it was last poisoned.
	PoisonStatePoisoned = "poisoned"
	// PoisonStateReplayed: sent back through the outbox, not (yet) processed.
	PoisonStateReplayed = "replayed"
	// PoisonStateQuarantined: replayed, but the relay moved the replay to
	// its quarantine (PoisonedMessage.ReplayQuarantine says which row and
	// why): it reaches no consumer until that row is replayed
	// (Client.Quarantine, Replay) once the cause is fixed.
	PoisonStateQuarantined = "quarantined"
	// PoisonStateProcessed: its consumer group's inbox records the event.
	PoisonStateProcessed = "processed"
	// PoisonStateSkipped: an operator skipped it (DLQ Skip) since it was
	// last poisoned; the messages parked behind it flowed on without it.
	PoisonStateSkipped = "skipped"
)

// checkPoison reports a filter field that can never match.
func checkPoison(f Filter) error {
	if f.Fingerprint != "" && !IsFingerprint(f.Fingerprint) {
		return fmt.Errorf("%w: fingerprint %q: want %d lowercase hex digits, as PoisonGroups reports them",
			ErrInvalidFilter, f.Fingerprint, store.FingerprintLength)
	}
	return nil
}

// IsFingerprint reports whether s is a failure group's fingerprint, as
// PoisonGroups reports them: 12 lowercase hex digits.
func IsFingerprint(s string) bool {
	if len(s) != store.FingerprintLength {
		return false
	}
	for _, r := range s {
		if (r < '0' || r > '9') && (r < 'a' || r > 'f') {
			return false
		}
	}
	return true
}

// poisonFilter is f as the store takes it, with ids.
func poisonFilter(f Filter, ids []int64) store.PoisonFilter {
	return store.PoisonFilter{RowFilter: rowFilter(f, ids), Handler: f.Handler, Group: f.Group, Fingerprint: f.Fingerprint}
}

// poisonQuery is the store query of the poison rows f (and ids) selects,
// read as r says.
func poisonQuery(f Filter, ids []int64, r store.Read) store.PoisonQuery {
	return store.PoisonQuery{Filter: poisonFilter(f, ids), Read: r}
}

// PoisonedMessage is one message of the poison table: its failure envelope,
// replays and state.
type PoisonedMessage struct {
	ID             int64      `json:"id"`               // the poison row's id (Get, Selection.IDs)
	ConsumerGroup  string     `json:"consumer_group"`   // the consumer group that poisoned it
	Handler        string     `json:"handler"`          // the handler that failed on it
	Topic          string     `json:"topic"`            // the source topic
	MessageID      string     `json:"message_id"`       // the broker message id of the failed delivery
	EventID        string     `json:"event_id"`         // the event id (the inbox key)
	EventType      string     `json:"event_type"`       // the event's type
	AggregateID    string     `json:"aggregate_id"`     // the event's aggregate id (its ordering key)
	State          string     `json:"state"`            // PoisonStatePoisoned, -Replayed, -Quarantined, -Processed or -Skipped
	ErrorClass     string     `json:"error_class"`      // middleware.ClassPermanent or middleware.ClassTransient
	Reason         string     `json:"reason"`           // the failure's reason, the error text
	Attempts       int        `json:"attempts"`         // attempts in its last delivery
	TimesPoisoned  int        `json:"times_poisoned"`   // how often it was poisoned (again after a replay)
	FirstFailureAt time.Time  `json:"first_failure_at"` // its first failed attempt
	LastFailureAt  time.Time  `json:"last_failure_at"`  // its last failed attempt
	PoisonedAt     time.Time  `json:"poisoned_at"`      // when it was last poisoned
	ReplayedAt     *time.Time `json:"replayed_at"`      // its last replay since it was last poisoned; nil if none
	SkippedAt      *time.Time `json:"skipped_at"`       // when it was skipped since it was last poisoned; nil if not
	ReplayCount    int        `json:"replay_count"`     // how often it was replayed
	ProcessedAt    *time.Time `json:"processed_at"`     // when its group's inbox recorded the event; nil if not
	PayloadBytes   int        `json:"payload_bytes"`    // the payload's size
	// Fingerprint names the message's failure group (PoisonGroups).
	Fingerprint string `json:"fingerprint"`
	// ReplayQuarantine is the relay quarantine's row holding the last
	// replay, in state PoisonStateQuarantined; nil otherwise.
	ReplayQuarantine *ReplayQuarantine `json:"replay_quarantine"`
}

// ReplayQuarantine is the relay quarantine's row of a replay the relay
// could not publish.
type ReplayQuarantine struct {
	// ID is the quarantined row's id (Client.Quarantine: Get, Replay).
	ID int64 `json:"id"`
	// Reason says why the relay quarantined it.
	Reason        string    `json:"reason"`
	QuarantinedAt time.Time `json:"quarantined_at"` // when the relay quarantined it
}

// PoisonedDetail is a poisoned message with its payload, metadata and
// replay history.
type PoisonedDetail struct {
	PoisonedMessage
	Traceparent string            `json:"traceparent"` // the W3C trace context it carried
	Metadata    map[string]string `json:"metadata"`    // its metadata as delivered
	Payload     []byte            `json:"payload"`     // its payload
	Replays     []PoisonReplay    `json:"replays"`     // its replay history, oldest first
}

// PoisonReplay is one replay of a poisoned message.
type PoisonReplay struct {
	ReplayedAt time.Time `json:"replayed_at"` // when it was replayed
	// MessageID is the message id the replay was sent with.
	MessageID string `json:"message_id"`
	// ReplayedBy names who replayed it (ReplayOptions.By).
	ReplayedBy string `json:"replayed_by"`
	// TimesPoisoned is the message's times_poisoned when it was replayed.
	TimesPoisoned int `json:"times_poisoned"`
}

func poisonedMessage(r store.PoisonRow) PoisonedMessage {
	m := PoisonedMessage{ID: r.ID, ConsumerGroup: r.ConsumerGroup, Handler: r.Handler, Topic: r.Topic,
		MessageID: r.MessageID, EventID: r.EventID, EventType: r.EventType, AggregateID: r.AggregateID,
		ErrorClass: r.ErrorClass, Reason: r.Reason, Attempts: r.Attempts, TimesPoisoned: r.TimesPoisoned,
		FirstFailureAt: r.FirstFailureAt, LastFailureAt: r.LastFailureAt, PoisonedAt: r.PoisonedAt,
		ReplayedAt: r.ReplayedAt, ReplayCount: r.ReplayCount, ProcessedAt: r.ProcessedAt, PayloadBytes: r.PayloadBytes,
		Fingerprint: r.Fingerprint, SkippedAt: r.SkippedAt}
	switch {
	case r.ProcessedAt != nil:
		m.State = PoisonStateProcessed
	case r.SkippedAt != nil:
		m.State = PoisonStateSkipped
	case r.ReplayQuarantine != nil:
		m.State = PoisonStateQuarantined
		m.ReplayQuarantine = &ReplayQuarantine{ID: r.ReplayQuarantine.ID, Reason: r.ReplayQuarantine.Reason,
			QuarantinedAt: r.ReplayQuarantine.QuarantinedAt}
	case r.ReplayedAt != nil:
		m.State = PoisonStateReplayed
	default:
		m.State = PoisonStatePoisoned
	}
	return m
}

// FailureGroup is one failure group of the poison table: the messages of
// one error class whose reasons are the same once UUIDs, numbers and
// runs of white space are set aside (only the first line counts).
type FailureGroup struct {
	// Fingerprint names the group: 12 hex digits from its error class and
	// normalised reason. Filter.Fingerprint selects its messages.
	Fingerprint string `json:"fingerprint"`
	ErrorClass  string `json:"error_class"` // the error class of its messages
	// Reason is the normalised reason ("order <n> not found").
	Reason string `json:"reason"`
	// Example is the newest message's own reason.
	Example string `json:"example"`
	// Messages counts the group's messages; Waiting those not replayed
	// since they were last poisoned.
	Messages int64 `json:"messages"`
	Waiting  int64 `json:"waiting"` // see Messages
	// Handlers and Topics are those of the group's messages, sorted.
	Handlers        []string  `json:"handlers"`
	Topics          []string  `json:"topics"`            // see Handlers
	FirstPoisonedAt time.Time `json:"first_poisoned_at"` // its oldest message's poisoning
	LastPoisonedAt  time.Time `json:"last_poisoned_at"`  // its newest message's poisoning
}

// PoisonGroups groups the poisoned messages f selects by failure
// fingerprint, the largest group first. Replay or purge a whole group with
// Selection{Filter: Filter{Fingerprint: g.Fingerprint}} on the DLQ.
func (c *Client) PoisonGroups(ctx context.Context, f Filter) ([]FailureGroup, error) {
	if err := checkPoison(f); err != nil {
		return nil, err
	}
	groups, err := c.tables.PoisonGroups(ctx, c.db, poisonFilter(f, nil))
	if err != nil {
		return nil, err
	}
	out := make([]FailureGroup, len(groups))
	for i, g := range groups {
		out[i] = FailureGroup(g)
	}
	return out, nil
}

// get returns the poisoned message id with its payload, metadata and
// replay history, or a *NotFoundError.
func (p poisonTable) get(ctx context.Context, id int64) (PoisonedDetail, error) {
	r, err := p.rows.get(ctx, id)
	if err != nil {
		return PoisonedDetail{}, err
	}
	replays, err := p.c.tables.PoisonReplays(ctx, p.c.db, id)
	if err != nil {
		return PoisonedDetail{}, err
	}
	d := PoisonedDetail{PoisonedMessage: poisonedMessage(r), Traceparent: r.Traceparent, Metadata: r.Metadata,
		Payload: r.Payload, Replays: make([]PoisonReplay, len(replays))}
	for i, rp := range replays {
		d.Replays[i] = PoisonReplay(rp)
	}
	return d, nil
}

// ReplayedEntry is a poisoned message that was (or would be) replayed.
type ReplayedEntry struct {
	ID            int64  `json:"id"`             // the poison row's id
	ConsumerGroup string `json:"consumer_group"` // the group that poisoned it
	Handler       string `json:"handler"`        // its handler
	Topic         string `json:"topic"`          // its topic
	EventID       string `json:"event_id"`       // its event id, kept by the replay
	EventType     string `json:"event_type"`     // its event type
	// MessageID is the replay's new message id; "" with DryRun.
	MessageID string `json:"message_id"`
	// TargetGroups are the consumer groups the replay is for, sorted: those
	// of the event's rows it replays (rows of one event share it). Every
	// other group of the topic acks it without processing it.
	TargetGroups []string `json:"target_groups"`
	// Parked is true when the row held its aggregate's park
	// (consumer.poison.park): the park was released, and the message goes
	// to the handler from the parked table ahead of the aggregate's parked
	// messages, with no outbox message; MessageID is then its own.
	Parked bool `json:"parked"`
}

// SkippedEntry is a selected poisoned message that was not replayed.
type SkippedEntry struct {
	ID            int64  `json:"id"`             // the poison row's id
	ConsumerGroup string `json:"consumer_group"` // the group that poisoned it
	Handler       string `json:"handler"`        // its handler
	Topic         string `json:"topic"`          // its topic
	EventID       string `json:"event_id"`       // its event id
	EventType     string `json:"event_type"`     // its event type
	// Reason is SkipAlreadyProcessed or SkipRefusedByBroker.
	Reason string `json:"reason"`
	// ProcessedAt is when the group's inbox recorded the event, for
	// SkipAlreadyProcessed; nil otherwise.
	ProcessedAt *time.Time `json:"processed_at"`
	// Detail says why the broker refuses the replay, for
	// SkipRefusedByBroker; "" otherwise.
	Detail string `json:"detail"`
}

// SkipAlreadyProcessed is the reason of a message not replayed because its
// consumer group's inbox records its event (see ReplayOptions.Force).
const SkipAlreadyProcessed = "already_processed"

// DLQ returns the dead-letter queue, the poison table. Its Replay sends
// the selected poisoned messages back to their topics
// through the outbox, in one transaction: one outbox message per event and
// topic, with a new message id (brokers that deduplicate by message id would
// drop the original's), the original event id (the inbox key) and payload,
// the event's own metadata (what Publish accepted: nothing a broker or the
// consumer chain added on the way, see bus.BrokerConfig.EventMetadata),
// middleware.ReplayOfKey naming the original message and
// middleware.ReplayGroupsKey naming the consumer groups of the replayed
// rows: only those groups process it, every other group of the topic acks
// it without calling its handler or writing its inbox. The rows get
// replayed_at and a history record. Messages whose consumer group's inbox
// already records the event are skipped unless opts.Force; so are those the
// configured broker would refuse (SkipRefusedByBroker: the relay would
// quarantine them), which Force replays with a warning. A row that holds a
// parked aggregate (consumer.poison.park) is not sent through the outbox:
// its park is released, and the message goes to its handler ahead of the
// aggregate's parked messages (ReplayedEntry.Parked). A selected id that
// does not exist is a *NotFoundError, and nothing changes.
func (c *Client) DLQ() DLQ {
	return DLQ{t: poisonTable{rows[store.PoisonRow, PoisonedMessage, store.PoisonQuery]{c: c, what: "poisoned message",
		query: poisonQuery, read: c.tables.Poison, id: func(r store.PoisonRow) int64 { return r.ID },
		version: poisonVersion, row: poisonedMessage, del: c.tables.DeletePoison}}}
}

// poisonTable is the DLQ's side of a Table.
type poisonTable struct {
	rows[store.PoisonRow, PoisonedMessage, store.PoisonQuery]
}

// check reports a filter field that can never match.
func (p poisonTable) check(f Filter) error { return checkPoison(f) }

// replayBatch is what a replay of poisoned messages writes: the outbox
// messages, and the poison rows replayed with the message id of each.
type replayBatch struct {
	opts       ReplayOptions
	res        *ReplayResult[ReplayedEntry, SkippedEntry]
	warned     map[string]bool
	outbox     []*message.Message
	ids        []int64
	messageIDs []string
}

// warn adds a warning to the result once.
func (b *replayBatch) warn(format string, args ...any) {
	if w := fmt.Sprintf(format, args...); !b.warned[w] {
		b.warned[w] = true
		b.res.Warnings = append(b.res.Warnings, w)
	}
}

// replay is the DLQ's Replay in tx.
func (p poisonTable) replay(ctx context.Context, tx *sql.Tx, sel Selection, opts ReplayOptions, res *ReplayResult[ReplayedEntry, SkippedEntry]) error {
	rows, err := p.selected(ctx, tx, sel, true, opts.DryRun, &res.Selection)
	if err != nil {
		return err
	}
	c := p.c
	// Rows that hold a park are released in place (parked.go).
	if rows, err = c.releaseParked(ctx, tx, rows, opts, res); err != nil {
		return err
	}
	b := &replayBatch{opts: opts, res: res, warned: map[string]bool{}}
	for _, event := range byEvent(rows) {
		if err := c.replayEvent(ctx, tx, event, b); err != nil {
			return err
		}
	}
	if opts.DryRun || len(b.ids) == 0 {
		return nil
	}
	if err := c.tables.WriteOutbox(ctx, tx, b.outbox); err != nil {
		return fmt.Errorf("millrace: %w", err)
	}
	if err := c.tables.MarkPoisonReplayed(ctx, tx, b.ids, b.messageIDs, cmp.Or(opts.By, "unknown")); err != nil {
		return fmt.Errorf("millrace: %w", err)
	}
	return nil
}

// byEvent groups rows by topic and event, in the order of their first
// rows: the broker gives one message to every consumer group of the topic,
// so several poisoned rows of one event need one message.
func byEvent(rows []store.PoisonRow) [][]store.PoisonRow {
	type eventKey struct{ topic, eventID string }
	index := map[eventKey]int{}
	var events [][]store.PoisonRow
	for _, r := range rows {
		k := eventKey{r.Topic, r.EventID}
		i, ok := index[k]
		if !ok {
			i = len(events)
			index[k] = i
			events = append(events, nil)
		}
		events[i] = append(events[i], r)
	}
	return events
}

// replayEvent adds to b the replay of one event's poisoned rows, or
// records why they are skipped.
func (c *Client) replayEvent(ctx context.Context, tx *sql.Tx, rows []store.PoisonRow, b *replayBatch) error {
	var chosen []store.PoisonRow
	for _, r := range rows {
		if r.ProcessedAt != nil && !b.opts.Force {
			b.res.Skipped = append(b.res.Skipped, skipped(r, SkipAlreadyProcessed, ""))
			continue
		}
		if q := r.ReplayQuarantine; q != nil {
			b.warn("message %d: its last replay is in the relay quarantine as row %d (%s); this replay sends a new message and leaves that row there: replay that row instead once the cause is fixed, or purge it",
				r.ID, q.ID, q.Reason)
		}
		chosen = append(chosen, r)
	}
	if len(chosen) == 0 {
		return nil
	}
	first := chosen[0]
	messageID := uuid.Must(uuid.NewV7()).String()
	groups := targetGroups(chosen)
	msg := c.replayMessage(first, messageID, groups)
	refused, overLimit := c.checkReplay(first.Topic, msg)
	if overLimit != nil {
		b.warn("message %d (event %s): Publish would refuse its replay now: %v", first.ID, first.EventID, overLimit)
	}
	if refused != nil {
		if !b.opts.Force {
			b.warn("message %d (event %s) is skipped: %v; the relay would quarantine its replay (fix the cause, or force the replay)", first.ID, first.EventID, refused)
			for _, r := range chosen {
				b.res.Skipped = append(b.res.Skipped, skipped(r, SkipRefusedByBroker, refused.Error()))
			}
			return nil
		}
		b.warn("message %d (event %s): %v; replayed because of Force, the relay will quarantine it", first.ID, first.EventID, refused)
	}
	payload, err := envelope.Wrap(first.Topic, msg)
	if err != nil {
		return fmt.Errorf("millrace: poisoned message %d: %w", first.ID, err)
	}
	b.outbox = append(b.outbox, message.NewMessage(messageID, payload))
	if b.opts.DryRun {
		messageID = ""
	}
	b.res.Messages++
	for _, r := range chosen {
		b.res.Replayed = append(b.res.Replayed, ReplayedEntry{ID: r.ID, ConsumerGroup: r.ConsumerGroup, Handler: r.Handler,
			Topic: r.Topic, EventID: r.EventID, EventType: r.EventType, MessageID: messageID, TargetGroups: groups})
		b.ids = append(b.ids, r.ID)
		b.messageIDs = append(b.messageIDs, messageID)
		if err := c.replayWarnings(ctx, tx, r, b.warn); err != nil {
			return err
		}
	}
	if age := time.Since(occurredAt(first)); age > c.cfg.Consumer.Inbox.Retention {
		b.warn("event %s on topic %s is older than consumer.inbox.retention (%s): consumer groups that processed it may have pruned it from their inbox and would process it again",
			first.EventID, first.Topic, c.cfg.Consumer.Inbox.Retention)
	}
	return nil
}

// skipped is the entry of r, not replayed for reason.
func skipped(r store.PoisonRow, reason, detail string) SkippedEntry {
	e := SkippedEntry{ID: r.ID, ConsumerGroup: r.ConsumerGroup, Handler: r.Handler, Topic: r.Topic,
		EventID: r.EventID, EventType: r.EventType, Reason: reason, Detail: detail}
	if reason == SkipAlreadyProcessed {
		e.ProcessedAt = r.ProcessedAt
	}
	return e
}

// replayWarnings warns when r's handler will not deduplicate its replay
// (no inbox) or will drop it as stale (the ordering guard).
func (c *Client) replayWarnings(ctx context.Context, tx *sql.Tx, r store.PoisonRow, warn func(string, ...any)) error {
	handler := c.cfg.Consumer.For(r.Handler)
	if !*handler.Inbox.Enabled {
		warn("handler %s has consumer.inbox.enabled false: nothing deduplicates its replays, so replaying a message twice processes it twice", r.Handler)
	}
	if !*handler.OrderingGuard {
		return nil
	}
	version, _ := strconv.ParseInt(r.Metadata[bus.AggregateVersionKey], 10, 64)
	aggType, aggID := r.Metadata[bus.AggregateTypeKey], r.Metadata[bus.AggregateIDKey]
	if version <= 0 || aggID == "" {
		return nil
	}
	applied, err := c.tables.AppliedVersion(ctx, tx, r.ConsumerGroup, aggType, aggID)
	if err != nil {
		return err
	}
	if applied >= version {
		warn("message %d: handler %s has the ordering guard on and has applied version %d of %s %s; the event is version %d, so the group drops its replay as stale",
			r.ID, r.Handler, applied, aggType, aggID, version)
	}
	return nil
}

// targetGroups are the consumer groups of rows, sorted, once each.
func targetGroups(rows []store.PoisonRow) []string {
	groups := make([]string, 0, len(rows))
	for _, r := range rows {
		groups = append(groups, r.ConsumerGroup)
	}
	slices.Sort(groups)
	return slices.Compact(groups)
}

// replayMessage is the message that re-sends r to its topic as messageID,
// for the consumer groups groups: the event's own metadata (bus.BrokerConfig.EventMetadata)
// and the replay markers.
func (c *Client) replayMessage(r store.PoisonRow, messageID string, groups []string) *message.Message {
	msg := message.NewMessage(messageID, r.Payload)
	msg.Metadata = c.cfg.Broker.EventMetadata(r.Topic, r.Metadata)
	if r.EventID != "" {
		// A message from plain Watermill had only its UUID as event id.
		msg.Metadata.Set(bus.EventIDKey, r.EventID)
	}
	msg.Metadata.Set(middleware.ReplayOfKey, r.MessageID)
	msg.Metadata.Set(middleware.ReplayGroupsKey, strings.Join(groups, middleware.ReplayGroupsSeparator))
	return msg
}

// occurredAt is when r's event happened, or when it first failed if it does
// not say.
func occurredAt(r store.PoisonRow) time.Time {
	if t, err := time.Parse(time.RFC3339Nano, r.Metadata[bus.OccurredAtKey]); err == nil {
		return t
	}
	return r.FirstFailureAt
}

// poisonVersion is what identifies a poison row's state: replaying it,
// poisoning it again, the relay quarantining its replay or its event being
// processed changes it.
func poisonVersion(r store.PoisonRow) string {
	v := fmt.Sprintf("%d/%d/%d", r.ID, r.TimesPoisoned, r.ReplayCount)
	if r.ReplayedAt != nil {
		v += "/r" + strconv.FormatInt(r.ReplayedAt.UnixNano(), 10)
	}
	if r.ReplayQuarantine != nil {
		v += "/q" + strconv.FormatInt(r.ReplayQuarantine.ID, 10)
	}
	if r.ProcessedAt != nil {
		v += "/p"
	}
	return v
}
