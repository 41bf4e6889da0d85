package main

import (
	"bytes"
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/brokertest"
	"github.com/millrace-io/millrace/internal/testdb"
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
	topic := "quickstart-" + testdb.UniqueName("")[2:]
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
