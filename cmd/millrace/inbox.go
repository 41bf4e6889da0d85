package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"io"

	"github.com/millrace-io/millrace/middleware"
)

func init() {
	commands = append(commands, command{
		path:    "inbox purge",
		summary: "delete inbox rows processed longer ago than --older-than, in short batches",
		bind:    bindInboxPurge,
	})
}

// inboxPurgeResult is the --json output of inbox purge.
type inboxPurgeResult struct {
	DryRun    bool     `json:"dry_run"`
	Deleted   int64    `json:"deleted"` // with --dry-run: rows that would be deleted
	OlderThan string   `json:"older_than"`
	Group     string   `json:"group"` // "" for every consumer group
	Batch     int      `json:"batch"`
	Warnings  []string `json:"warnings"`
}

func bindInboxPurge(fs *flag.FlagSet) runFunc {
	var olderThan durationFlag
	fs.Var(&olderThan, "older-than", "required: delete rows processed longer ago than `DURATION` (90m, 720h, 30d)")
	group := fs.String("group", "", "only rows of this consumer `group`")
	batch := fs.Int("batch", 0, "rows per DELETE statement, `N` (default consumer.inbox.cleanup_batch)")
	dryRun := fs.Bool("dry-run", false, "count the rows that would be deleted; change nothing")
	return func(ctx context.Context, e env, args []string) error {
		if err := noArgs(args); err != nil {
			return err
		}
		if olderThan.d == 0 {
			return usagef("--older-than is required: how long ago a row must have been processed to be deleted")
		}
		n := e.cfg.Consumer.Inbox.CleanupBatch
		if flagSet(fs, "batch") {
			if *batch <= 0 {
				return usagef("--batch must be positive; got %d", *batch)
			}
			n = *batch
		}
		res := inboxPurgeResult{DryRun: *dryRun, OlderThan: olderThan.d.String(), Group: *group,
			Batch: n, Warnings: []string{}}
		if retention := e.cfg.Consumer.Inbox.Retention; olderThan.d < retention {
			res.Warnings = append(res.Warnings, fmt.Sprintf("--older-than %s is shorter than consumer.inbox.retention (%s): "+
				"a redelivery or replay of an event whose row is deleted is processed again", olderThan.d, retention))
		}
		t := tablesOf(e.cfg)
		db, err := openDB(ctx, e.cfg, t.Inbox())
		if err != nil {
			return err
		}
		defer db.Close()
		if *dryRun {
			err = db.QueryRowContext(ctx, `SELECT count(*) FROM `+t.Inbox()+`
WHERE processed_at < now() - make_interval(secs => $1) AND ($2 = '' OR consumer_group = $2)`,
				olderThan.d.Seconds(), *group).Scan(&res.Deleted)
		} else if *group == "" {
			res.Deleted, err = middleware.PruneInbox(ctx, db, e.cfg.Database.Schema, olderThan.d, res.Batch)
		} else {
			res.Deleted, err = pruneInboxGroup(ctx, db, e, olderThan.d.Seconds(), *group, res.Batch)
		}
		if err != nil {
			return fmt.Errorf("%w (%d rows deleted before the error)", err, res.Deleted)
		}
		if !e.asJSON {
			for _, w := range res.Warnings {
				fmt.Fprintln(e.errOut, "warning:", w)
			}
		}
		return e.print(res, func(w io.Writer) {
			scope := "every consumer group"
			if res.Group != "" {
				scope = "consumer group " + res.Group
			}
			if res.DryRun {
				fmt.Fprintf(w, "dry run: %d inbox rows of %s processed more than %s ago would be deleted; nothing changed\n", res.Deleted, scope, res.OlderThan)
			} else {
				fmt.Fprintf(w, "deleted %d inbox rows of %s processed more than %s ago\n", res.Deleted, scope, res.OlderThan)
			}
		})
	}
}

// pruneInboxGroup is middleware.PruneInbox for one consumer group (which
// PruneInbox has no parameter for): short batches, skipping locked rows.
func pruneInboxGroup(ctx context.Context, db *sql.DB, e env, olderThanSecs float64, group string, batch int) (int64, error) {
	inbox := tablesOf(e.cfg).Inbox()
	query := `DELETE FROM ` + inbox + ` WHERE (consumer_group, event_id) IN (
	SELECT consumer_group, event_id FROM ` + inbox + `
	WHERE consumer_group = $3 AND processed_at < now() - make_interval(secs => $1)
	ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)`
	var total int64
	for {
		res, err := db.ExecContext(ctx, query, olderThanSecs, batch, group)
		if err != nil {
			return total, fmt.Errorf("prune inbox %s: %w", inbox, err)
		}
		n, _ := res.RowsAffected()
		total += n
		if n < int64(batch) {
			return total, nil
		}
	}
}

// flagSet reports whether the flag name was given on the command line.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
