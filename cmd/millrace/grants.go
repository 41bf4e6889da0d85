package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/store"
)

func init() {
	commands = append(commands, command{
		path:    "grants",
		summary: "print the GRANT statements that give a service role exactly the privileges millrace needs at run time",
		bind:    stringFlag("role", "the PostgreSQL role the services run as (required)", runGrants),
	})
}

func runGrants(_ context.Context, e env, args []string, grantsRole string) error {
	if err := noArgs(args); err != nil {
		return err
	}
	if grantsRole == "" {
		return usageError{errors.New("--role is required")}
	}
	sql, err := bus.GrantSQL(e.cfg, grantsRole)
	if err != nil {
		return usageError{err}
	}
	type grant struct {
		Privilege string `json:"privilege"`
		Kind      string `json:"kind"`
		Object    string `json:"object"`
		Use       string `json:"use"`
	}
	var list []grant
	for _, g := range store.Grants(store.Tables{Schema: e.cfg.Database.Schema, OutboxTopic: e.cfg.Outbox.Topic}) {
		list = append(list, grant{g.Privilege, g.Kind, g.Object, g.Use})
	}
	if e.cfg.Relay.Source == forwarder.SourceWAL {
		list = append(list, grant{"REPLICATION", "ROLE", `"` + grantsRole + `"`, store.ReplicationUse})
	}
	return e.print(map[string]any{"role": grantsRole, "grants": list, "sql": sql}, func(w io.Writer) {
		fmt.Fprint(w, sql)
	})
}
