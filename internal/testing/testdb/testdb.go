// Package testdb gives each test its own PostgreSQL schema on the server named
// by DATABASE_URL (default: the local server `make up` provides), so tests run
// in parallel without seeing each other's tables.
package testdb

import (
	"context"
	"database/sql"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver

	"github.com/millrace-io/millrace/internal/testing/testkit"
)

// DefaultURL is the local PostgreSQL `make up` provides.
const DefaultURL = "postgres://postgres:postgres@127.0.0.1:5432/postgres?sslmode=disable"

// URL returns DATABASE_URL or DefaultURL.
func URL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// Open returns a pool on URL() that is closed when the test ends. The test
// fails (it is not skipped) when the server does not answer: `make test`
// starts it with `make up`.
func Open(t testing.TB) *sql.DB {
	t.Helper()
	return OpenURL(t, URL())
}

// OpenURL returns a pool on url (a private server's, say) that is closed
// when the test ends; the test fails when the server does not answer.
func OpenURL(t testing.TB, url string) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatalf("open %s: %v", url, err)
	}
	t.Cleanup(func() { db.Close() })
	if err := db.PingContext(context.Background()); err != nil {
		t.Fatalf("PostgreSQL at %s is not reachable (run `make up` for the shared one): %v", url, err)
	}
	return db
}

// Pool returns a pgxpool on URL() that is closed when the test ends.
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), URL())
	if err != nil {
		t.Fatalf("open a pgxpool on %s: %v", URL(), err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Schema creates a fresh, uniquely named schema dropped when the test ends,
// and returns its name.
func Schema(t testing.TB, db *sql.DB) string {
	t.Helper()
	name := SchemaName(t, db, t.Name())
	if _, err := db.Exec(`CREATE SCHEMA "` + name + `"`); err != nil {
		t.Fatalf("create schema %s: %v", name, err)
	}
	return name
}

// SchemaName returns a fresh, unique schema name made from base, for code
// under test that creates the schema itself (Migrate does); the schema is
// dropped, if it exists, when the test ends.
func SchemaName(t testing.TB, db *sql.DB, base string) string {
	t.Helper()
	name := UniqueName(base)
	t.Cleanup(func() {
		if _, err := db.Exec(`DROP SCHEMA IF EXISTS "` + name + `" CASCADE`); err != nil {
			t.Errorf("drop schema %s: %v", name, err)
		}
	})
	return name
}

// UniqueName turns a test name into a short lowercase identifier with a
// random suffix, usable as a schema, topic or consumer-group name.
func UniqueName(testName string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(testName) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			b.WriteRune('_')
		}
	}
	base := b.String()
	if len(base) > 40 {
		base = base[len(base)-40:]
	}
	return "t_" + strings.Trim(base, "_") + "_" + testkit.Suffix()
}

// Column runs query on db and returns its one column, row by row, failing
// t on any error.
func Column[T any](t testing.TB, db *sql.DB, query string, args ...any) []T {
	t.Helper()
	rows, err := db.Query(query, args...)
	if err != nil {
		t.Fatalf("query %q: %v", query, err)
	}
	defer rows.Close()
	var values []T
	for rows.Next() {
		var v T
		if err := rows.Scan(&v); err != nil {
			t.Fatalf("read a row of %q: %v", query, err)
		}
		values = append(values, v)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("read the rows of %q: %v", query, err)
	}
	return values
}
