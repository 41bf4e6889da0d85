package main

import (
	"fmt"
	"io"
	"time"

	"github.com/millrace-io/millrace/ops"
)

// quarantine is the relay quarantine's table of commands.
var quarantine = table[ops.QuarantinedRow, ops.QuarantinedDetail, ops.QuarantinedRow, ops.QuarantineSkipped]{
	name: "quarantine",
	of:   (*ops.Client).Quarantine,
	flags: tableFlags{rows: "rows", idNoun: "quarantined row", listCommand: "millrace quarantine list", idKind: "row",
		topic: "only rows for this destination `topic`", reason: "only rows whose reason contains `text` (case-insensitive)",
		at: "quarantined", all: "select every row of the relay quarantine (instead of IDs or filters)"},
	none:          "no quarantined rows match",
	unit:          "row(s)",
	header:        "ID\tQUARANTINED AT\tTOPIC\tEVENT ID\tOFFSET\tREPLAYED\tREASON",
	line:          quarantineLine,
	show:          quarantineShow,
	writeReplay:   writeQuarantineReplay,
	forceUsage:    "also replay rows the configured broker still refuses (the relay quarantines them again)",
	purgeQuestion: func(n int) string { return fmt.Sprintf("purge all %d quarantined row(s) for good?", n) },
	summaries: map[string]string{
		"list":   "list outbox rows the relay set aside (no broker could take them), newest first, with the reason",
		"show":   "one quarantined row: reason, envelope, the event's metadata and payload",
		"replay": "write quarantined rows back into the outbox as they were (same event id) once the cause is fixed",
		"purge":  "delete quarantined rows",
	},
}

func init() {
	commands = append(commands, quarantine.commands()...)
}

// quarantineLine is a row's line in quarantine list and quarantine purge.
func quarantineLine(r ops.QuarantinedRow) string {
	return fmt.Sprintf("%d\t%s\t%s\t%s\t%d\t%d\t%s", r.ID, r.QuarantinedAt.Format(time.RFC3339),
		cell(r.Topic, 40), cell(r.EventID, 36), r.OutboxOffset, r.TimesReplayed, cell(r.Reason, 60))
}

// quarantineShowResult is the --json output of quarantine show.
type quarantineShowResult struct {
	ops.QuarantinedRow
	EnvelopeError string            `json:"envelope_error"`
	Metadata      map[string]string `json:"metadata"`
	Payload       payloadView       `json:"payload"`
	Envelope      payloadView       `json:"envelope"`
}

// quarantineShow is the --json value and the text of quarantine show.
func quarantineShow(d ops.QuarantinedDetail, asHex bool) (any, func(w io.Writer)) {
	res := quarantineShowResult{QuarantinedRow: d.QuarantinedRow, EnvelopeError: d.EnvelopeError,
		Metadata: d.Metadata, Payload: viewPayload(d.Payload, asHex), Envelope: viewPayload(d.Envelope, asHex)}
	return res, func(w io.Writer) {
		field := func(name string, value any) { fmt.Fprintf(w, "%-16s %v\n", name+":", value) }
		field("id", res.ID)
		field("topic", cell(res.Topic, 200))
		field("event id", cell(res.EventID, 200))
		field("outbox offset", res.OutboxOffset)
		field("quarantined at", res.QuarantinedAt.Format(time.RFC3339Nano))
		field("replayed at", timeText(res.ReplayedAt, "never"))
		field("times replayed", res.TimesReplayed)
		fmt.Fprintln(w, "reason:")
		writeIndented(w, res.Reason)
		if res.EnvelopeError != "" {
			fmt.Fprintf(w, "envelope (%d bytes, unreadable: %s)\n", res.Envelope.Bytes, res.EnvelopeError)
			return
		}
		writeMetadata(w, res.Metadata)
		writePayload(w, res.Payload)
	}
}

// writeQuarantineReplay writes the text result of quarantine replay.
func writeQuarantineReplay(w io.Writer, res ops.ReplayResult[ops.QuarantinedRow, ops.QuarantineSkipped]) {
	verb := "replayed"
	if res.DryRun {
		verb = "would replay"
	}
	for _, r := range res.Replayed {
		fmt.Fprintf(w, "%s %d (topic %s, event %s)\n", verb, r.ID, r.Topic, r.EventID)
	}
	for _, s := range res.Skipped {
		fmt.Fprintf(w, "skipped %d (%s): %s\n", s.ID, s.Skip, s.Detail)
	}
	if res.DryRun {
		fmt.Fprintf(w, "dry run: %d row(s) would be written to the outbox; nothing changed\n", res.Messages)
	} else {
		fmt.Fprintf(w, "%d row(s) written to the outbox; the relay publishes them again\n", res.Messages)
	}
}
