package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/millrace-io/millrace/ops"
)

// dlq is the dead-letter queue's table of commands.
var dlq = table[ops.PoisonedMessage, ops.PoisonedDetail, ops.ReplayedEntry, ops.SkippedEntry]{
	name: "dlq",
	of:   (*ops.Client).DLQ,
	flags: tableFlags{rows: "messages", idNoun: "poison message", listCommand: "millrace dlq list", idKind: "message",
		topic: "only messages of this source `topic`", reason: "only messages whose failure reason contains `text` (case-insensitive)",
		at: "poisoned", replayed: " since they were last poisoned", dlq: true,
		all: "select every message of the poison table (instead of IDs or filters)"},
	none:        "no poisoned messages match",
	unit:        "message(s)",
	header:      "ID\tPOISONED AT\tGROUP\tHANDLER\tTOPIC\tEVENT TYPE\tAGGREGATE\tCLASS\tTIMES\tSTATE\tREASON",
	line:        dlqLine,
	show:        dlqShow,
	writeReplay: writeReplay,
	forceUsage:  "also replay messages whose event the consumer group's inbox already records (the group acks them as duplicates), and those the broker would refuse (the relay quarantines them)",
	purgeQuestion: func(n int) string {
		return fmt.Sprintf("purge all %d poisoned message(s) and their replay history for good?", n)
	},
	summaries: map[string]string{
		"list":   "list poisoned messages, newest first, with their failure reason and state",
		"show":   "one poisoned message: failure envelope, metadata, payload, replay history",
		"replay": "send poisoned messages back to their topic through the outbox (same event id: the inbox keeps the effect single)",
		"purge":  "delete poisoned messages and their replay history",
	},
}

func init() {
	// dlq groups comes second, after dlq list, in usages.
	table := dlq.commands()
	commands = append(commands, table[0],
		command{path: "dlq groups", summary: "poisoned messages grouped by failure fingerprint (error class and reason, ids and numbers set aside), largest first", bind: bindGroups})
	commands = append(commands, table[1:]...)
	commands = append(commands,
		command{path: "dlq skip", args: "[ID...]", summary: "give up on poisoned messages for good: mark them skipped; the aggregates they parked flow on without them",
			bind: bindSkip},
		command{path: "dlq parked", summary: "aggregates an ordered handler holds parked behind a poisoned message (consumer.poison.park), the longest parked first",
			bind: bindParked})
}

func bindGroups(fs *flag.FlagSet) runFunc {
	f := filter{tableFlags: dlq.flags}
	f.register(fs, 0, "")
	return func(ctx context.Context, e env, args []string) error {
		return f.withOps(ctx, e, args, func(oc *ops.Client) error {
			groups, err := oc.PoisonGroups(ctx, f.filter())
			if err != nil {
				return err
			}
			l := listed[ops.FailureGroup]{rows: groups, none: dlq.none, more: "(replay or purge a group with --fingerprint FP)",
				header: "FINGERPRINT\tMESSAGES\tWAITING\tCLASS\tHANDLERS\tLAST POISONED\tREASON",
				line: func(g ops.FailureGroup) string {
					return fmt.Sprintf("%s\t%d\t%d\t%s\t%s\t%s\t%s", g.Fingerprint, g.Messages, g.Waiting, g.ErrorClass,
						cell(strings.Join(g.Handlers, ","), 30), g.LastPoisonedAt.Format(time.RFC3339), cell(g.Reason, 70))
				}}
			return e.print(map[string]any{"groups": groups}, l.write)
		})
	}
}

// dlqLine is a message's row in dlq list and dlq purge.
func dlqLine(r ops.PoisonedMessage) string {
	return fmt.Sprintf("%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s", r.ID, r.PoisonedAt.Format(time.RFC3339),
		r.ConsumerGroup, r.Handler, r.Topic, cell(r.EventType, 30), cell(r.AggregateID, 30), r.ErrorClass, r.TimesPoisoned, r.State, cell(r.Reason, 60))
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
	ops.PoisonedMessage
	Traceparent string             `json:"traceparent"`
	Metadata    map[string]string  `json:"metadata"`
	Payload     payloadView        `json:"payload"`
	Replays     []ops.PoisonReplay `json:"replays"`
}

// payloadView is a payload as JSON (encoding "json", value the JSON itself) or
// as text (encoding "base64" or "hex", value a string).
type payloadView struct {
	Bytes    int    `json:"bytes"`
	Encoding string `json:"encoding"`
	Value    any    `json:"value"`
}

// dlqShow is the --json value and the text of dlq show.
func dlqShow(d ops.PoisonedDetail, asHex bool) (any, func(w io.Writer)) {
	res := showResult{PoisonedMessage: d.PoisonedMessage, Traceparent: d.Traceparent, Metadata: d.Metadata,
		Replays: d.Replays, Payload: viewPayload(d.Payload, asHex)}
	return res, func(w io.Writer) { writeShow(w, res) }
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
	if q := r.ReplayQuarantine; q != nil {
		field("replay", fmt.Sprintf("in the relay quarantine since %s as row %d: %s (fix the cause, then `millrace quarantine replay %d`)",
			q.QuarantinedAt.Format(time.RFC3339), q.ID, cell(q.Reason, 200), q.ID))
	}
	field("processed at", timeText(r.ProcessedAt, "not recorded in the consumer group's inbox"))
	fmt.Fprintln(w, "reason:")
	writeIndented(w, r.Reason)
	writeMetadata(w, r.Metadata)
	writePayload(w, r.Payload)
	fmt.Fprintf(w, "replays (%d):\n", len(r.Replays))
	for _, rp := range r.Replays {
		fmt.Fprintf(w, "  %s by %s as message %s (after poisoning %d)\n",
			rp.ReplayedAt.Format(time.RFC3339), rp.ReplayedBy, rp.MessageID, rp.TimesPoisoned)
	}
}

// writeMetadata writes metadata sorted by key, for show commands.
func writeMetadata(w io.Writer, metadata map[string]string) {
	fmt.Fprintln(w, "metadata:")
	if len(metadata) == 0 {
		fmt.Fprintln(w, "  (none)")
	}
	for _, k := range slices.Sorted(maps.Keys(metadata)) {
		fmt.Fprintf(w, "  %s: %s\n", k, metadata[k])
	}
}

// writePayload writes a payload as JSON, a hex dump or base64, for show commands.
func writePayload(w io.Writer, p payloadView) {
	switch p.Encoding {
	case "json":
		fmt.Fprintf(w, "payload (%d bytes, JSON):\n", p.Bytes)
		var pretty bytes.Buffer
		raw := p.Value.(json.RawMessage)
		if err := json.Indent(&pretty, raw, "", "  "); err != nil {
			pretty.Reset()
			pretty.Write(raw)
		}
		writeIndented(w, pretty.String())
	case "hex":
		fmt.Fprintf(w, "payload (%d bytes, not JSON; shown as a hex dump):\n", p.Bytes)
		writeIndented(w, strings.TrimSuffix(hex.Dump(mustDecodeHex(p.Value.(string))), "\n"))
	default:
		fmt.Fprintf(w, "payload (%d bytes, not JSON; shown as base64, decode with `base64 -d`, or use --hex):\n", p.Bytes)
		writeIndented(w, p.Value.(string))
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

func writeReplay(w io.Writer, res ops.ReplayResult[ops.ReplayedEntry, ops.SkippedEntry]) {
	verb := "replayed"
	if res.DryRun {
		verb = "would replay"
	}
	for _, r := range res.Replayed {
		fmt.Fprintf(w, "%s %d (group %s, handler %s, topic %s, event %s)", verb, r.ID, r.ConsumerGroup, r.Handler, r.Topic, r.EventID)
		if r.Parked { // parked.go
			fmt.Fprintf(w, ": its parked aggregate is released, the message goes to group %s ahead of the messages parked behind it\n", r.ConsumerGroup)
			continue
		}
		if r.MessageID != "" {
			fmt.Fprintf(w, " as message %s", r.MessageID)
		}
		fmt.Fprintf(w, " for consumer group(s) %s\n", strings.Join(r.TargetGroups, ", "))
	}
	for _, s := range res.Skipped {
		fmt.Fprintf(w, "skipped %d (group %s, handler %s, topic %s, event %s): ", s.ID, s.ConsumerGroup, s.Handler, s.Topic, s.EventID)
		if s.Reason == ops.SkipAlreadyProcessed {
			fmt.Fprintf(w, "already processed, the group's inbox recorded the event at %s (--force replays it anyway)\n", timeText(s.ProcessedAt, "-"))
		} else {
			fmt.Fprintf(w, "%s (--force replays it anyway, and the relay quarantines it)\n", s.Detail)
		}
	}
	switch {
	case res.DryRun:
		fmt.Fprintf(w, "dry run: %d message(s) would be written to the outbox, each processed only by the group(s) it is for; nothing changed\n", res.Messages)
	default:
		fmt.Fprintf(w, "%d message(s) written to the outbox; the relay delivers each to every consumer group of its topic, and only the group(s) it is for process it\n", res.Messages)
	}
}

// Parked aggregates are listed under dlq (`dlq parked`), not as a command
// of their own: a park exists only because of a poisoned message, and it
// is released by acting on that message (`dlq replay` or `dlq skip`), so
// the operator finds the park, its poisoned message and the way out in
// one place.

func bindSkip(fs *flag.FlagSet) runFunc {
	question := func(n int) string { return fmt.Sprintf("skip all %d poisoned message(s) for good?", n) }
	return bindSelected(fs, dlq.flags, "skip", "skipped", question, map[string]string{"skipped": "would_skip", "released": "would_release"},
		func(ctx context.Context, oc *ops.Client, sel ops.Selection, dryRun bool) (ops.SkipResult[ops.PoisonedMessage], int, string, error) {
			res, err := oc.DLQ().Skip(ctx, sel, dryRun)
			return res, len(res.Skipped), res.Selection, err
		},
		func(res ops.SkipResult[ops.PoisonedMessage]) bool { return res.DryRun }, writeSkip)
}

func writeSkip(w io.Writer, res ops.SkipResult[ops.PoisonedMessage]) {
	summary := fmt.Sprintf("skipped %d message(s); %d parked aggregate(s) flow on without them", len(res.Skipped), res.Released)
	if res.DryRun {
		summary = fmt.Sprintf("dry run: %d message(s) would be skipped, releasing %d parked aggregate(s); nothing changed", len(res.Skipped), res.Released)
	}
	listed[ops.PoisonedMessage]{rows: res.Skipped, none: dlq.none, header: dlq.header, line: dlq.line, more: summary}.write(w)
}

func bindParked(fs *flag.FlagSet) runFunc {
	var f ops.ParkedFilter
	fs.StringVar(&f.Group, "group", "", "only aggregates parked by this consumer `group`")
	fs.StringVar(&f.Handler, "handler", "", "only aggregates parked by this `handler`")
	fs.StringVar(&f.Key, "key", "", "only this order `key` (aggregate id, or a saga's correlation id)")
	fs.StringVar(&f.State, "state", "", "only parks in this `state`: held (waiting for dlq replay or skip) or draining")
	limit := fs.Int("limit", 100, "show at most `N` parked aggregates (0: no limit)")
	return func(ctx context.Context, e env, args []string) error {
		if err := noArgs(args); err != nil {
			return err
		}
		if f.State != "" && f.State != ops.ParkStateHeld && f.State != ops.ParkStateDraining {
			return usagef("--state: want %s or %s; got %q", ops.ParkStateHeld, ops.ParkStateDraining, f.State)
		}
		return withOps(ctx, e, func(oc *ops.Client) error {
			res, err := oc.Parked(ctx, f, *limit)
			if err != nil {
				return err
			}
			l := listed[ops.ParkedAggregate]{rows: res.Rows, none: "no aggregates are parked",
				header: "GROUP\tHANDLER\tKEY\tSTATE\tPARKED\tSINCE\tPOISON ID\tTOPIC",
				line: func(p ops.ParkedAggregate) string {
					return fmt.Sprintf("%s\t%s\t%s\t%s\t%d\t%s\t%d\t%s", p.ConsumerGroup, p.Handler, cell(p.Key, 40), p.State, p.Parked,
						p.Since.Format(time.RFC3339), p.PoisonID, p.Topic)
				}}
			if res.Truncated {
				l.more = fmt.Sprintf("(more aggregates are parked; showing %d, raise --limit to see more)", *limit)
			} else if len(res.Rows) > 0 {
				l.more = "(release one with `millrace dlq replay POISON_ID` or `millrace dlq skip POISON_ID`)"
			}
			return e.print(map[string]any{"parked": res.Rows, "truncated": res.Truncated}, l.write)
		})
	}
}
