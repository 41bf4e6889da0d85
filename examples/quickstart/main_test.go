package main

import (
	"bytes"
	"context"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// The quick start runs end to end against the local PostgreSQL and NATS,
// in a schema and on a topic of its own: three orders placed, three
// invoices, one per event.
func TestQuickstartRuns(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	schema := testdb.Schema(t, db)
	cfg, err := bus.LoadConfig("config.yaml")
	require.NoError(t, err)
	cfg.Database.Schema = schema
	// The service's unqualified tables go to the test's schema too.
	u, err := url.Parse(cfg.Database.URL)
	require.NoError(t, err)
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	cfg.Database.URL = u.String()
	topic := "quickstart-_" + testkit.Suffix()
	brokertest.Cleanup(t, bus.KindNATS, topic, "billing")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	require.NoError(t, run(ctx, cfg, topic, &out))
	require.Regexp(t, `^placed ord-[0-9a-f]{8}\nplaced ord-[0-9a-f]{8}\nplaced ord-[0-9a-f]{8}\nbilled 3 orders, each once\n$`, out.String())

	var invoices, inbox int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+schema+`".invoices`).Scan(&invoices))
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+schema+`".millrace_inbox WHERE consumer_group = 'billing'`).Scan(&inbox))
	require.Equal(t, 3, invoices)
	require.Equal(t, 3, inbox)
}

// The README's Quick start shows this program's code, as it is.
func TestReadmeShowsTheQuickstart(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	program, err := os.ReadFile("main.go")
	require.NoError(t, err)
	_, section, found := strings.Cut(string(readme), "\n## Quick start\n")
	require.True(t, found, "README has a Quick start section")
	_, block, found := strings.Cut(section, "```go\n")
	require.True(t, found, "the Quick start has a Go block")
	block, _, found = strings.Cut(block, "```\n")
	require.True(t, found)
	require.Contains(t, block, "func run(", "the block is the program's, not a sketch")
	require.Contains(t, string(program), block, "the README's Quick start block is a part of main.go word for word")
}
