package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testdb"
)

func TestDemoWritesOneEventPerCommittedOrder(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	var cfg bus.Config
	cfg.Database.URL = testdb.URL()
	cfg.Database.Schema = testdb.Schema(t, db)
	cfg.Broker.NATS.URL = "nats://127.0.0.1:4222"

	var out bytes.Buffer
	n, err := run(context.Background(), cfg, 5, &out)
	require.NoError(t, err)
	require.Equal(t, 5, n, out.String())
	require.Contains(t, out.String(), "outbox holds 5 events for this run")

	var orders int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+cfg.Database.Schema+`".orders`).Scan(&orders))
	require.Equal(t, 5, orders, "the rolled-back order left no row either")
}
