package store_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// GrantSQL grants every listed privilege, also for an outbox topic so long
// that PostgreSQL shortened its sequence's name.
func TestGrantSQLGrantsEveryListedPrivilege(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Open(t)
	for _, topic := range []string{"millrace_outbox", strings.Repeat("t", store.MaxOutboxTopicLength)} {
		tables := store.Tables{Schema: testdb.Schema(t, db), OutboxTopic: topic}
		role := tables.Schema + "_svc"
		_, err := db.Exec(fmt.Sprintf(`CREATE ROLE %q NOLOGIN`, role))
		require.NoError(t, err)
		t.Cleanup(func() {
			_, _ = db.Exec(fmt.Sprintf(`DROP OWNED BY %q`, role))
			_, _ = db.Exec(fmt.Sprintf(`DROP ROLE %q`, role))
		})
		require.NoError(t, store.Migrate(ctx, db, tables))
		sql, err := store.GrantSQL(tables, role)
		require.NoError(t, err)
		_, err = db.Exec(sql)
		require.NoError(t, err, sql)

		var seqGranted bool
		require.NoError(t, db.QueryRow(`SELECT has_sequence_privilege($1, pg_get_serial_sequence($2, 'offset'), 'USAGE')`,
			role, tables.OutboxTable()).Scan(&seqGranted))
		require.True(t, seqGranted, "topic %q: the outbox sequence", topic)
		for _, g := range store.Grants(tables) {
			var ok bool
			switch g.Kind {
			case "SCHEMA":
				require.NoError(t, db.QueryRow(`SELECT has_schema_privilege($1, $2, $3)`, role, tables.Schema, g.Privilege).Scan(&ok))
			case "TABLE":
				require.NoError(t, db.QueryRow(`SELECT has_table_privilege($1, $2, $3)`, role, g.Object, g.Privilege).Scan(&ok))
			case "SEQUENCE":
				continue // checked above by its real name
			}
			require.True(t, ok, "%s on %s", g.Privilege, g.Object)
		}
	}
}

func TestGrantSQLRefusesHostileNames(t *testing.T) {
	t.Parallel()
	ok := store.Tables{Schema: "public", OutboxTopic: "millrace_outbox"}
	for _, role := range []string{`app"; DROP TABLE x; --`, "App", "", strings.Repeat("r", 64), "app\n"} {
		_, err := store.GrantSQL(ok, role)
		require.ErrorContains(t, err, "role", role)
	}
	_, err := store.GrantSQL(store.Tables{Schema: `public"; --`, OutboxTopic: "millrace_outbox"}, "app")
	require.ErrorContains(t, err, "schema")
}
