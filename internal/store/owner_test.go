package store_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// sqlStatement matches the start of an SQL statement or clause.
var sqlStatement = regexp.MustCompile(`(?i)\b(SELECT|INSERT\s+INTO|UPDATE|DELETE\s+FROM|ALTER\s+TABLE|CREATE\s+(TABLE|INDEX|TRIGGER)|DROP\s+TABLE|TRUNCATE|FROM|JOIN)\s`)

// tableName matches the store.Tables methods that name a table (and the
// names they had before the store owned them).
var tableName = regexp.MustCompile(`^(Outbox|Offsets|Cursors|Instances|Inbox|RelayQuarantine|Quarantine|Poison|PoisonReplays|AggregateVersions)Table$|^(Outbox|Offsets|Inbox|RelayQuarantine|Poison|PoisonReplays|AggregateVersions)$`)

// millraceTable matches the names of millrace's tables.
var millraceTable = regexp.MustCompile(`\b(millrace_(inbox|poison|poison_replays|relay_quarantine|relay_cursors|relay_instances|aggregate_versions)|watermill_offsets_\w+|watermill_\w+)\b`)

// The store is the one owner of millrace's tables: no other package's
// runtime code writes SQL against them, neither naming a table in a query
// nor building one from a store.Tables name (...Table()).
func TestNoSQLOnMillraceTablesOutsideTheStore(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	var found []string
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		switch {
		case d.IsDir() && (strings.HasPrefix(d.Name(), ".") || rel == filepath.Join("internal", "store")):
			return filepath.SkipDir
		case d.IsDir(), !strings.HasSuffix(path, ".go"), strings.HasSuffix(path, "_test.go"):
			return nil
		}
		found = append(found, sqlOnTables(t, path, rel)...)
		return nil
	})
	require.NoError(t, err)
	require.Empty(t, found, "SQL on millrace's tables belongs in internal/store; move these queries there")
}

// sqlOnTables lists the places in one file that put SQL and a millrace
// table together: a string literal with both, or a + expression joining an
// SQL literal and a call of a ...Table() name.
func sqlOnTables(t *testing.T, path, rel string) []string {
	fset := token.NewFileSet()
	file, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
	require.NoError(t, err, path)
	var found []string
	report := func(n ast.Node, what string) {
		found = append(found, rel+":"+strconv.Itoa(fset.Position(n.Pos()).Line)+": "+what)
	}
	ast.Inspect(file, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.BasicLit:
			if s := literal(n); sqlStatement.MatchString(s) && millraceTable.MatchString(s) {
				report(n, "a query naming a millrace table")
			}
		case *ast.BinaryExpr:
			if n.Op != token.ADD {
				return true
			}
			if joinsSQLAndTable(flatten(n)) {
				report(n, "a query built from a store.Tables name")
			}
			return false // its operands were looked at
		case *ast.CallExpr:
			// fmt.Sprintf("SELECT ... FROM %s", t.InboxTable()) and the like.
			if joinsSQLAndTable(n.Args) {
				report(n, "a query built from a store.Tables name")
			}
		}
		return true
	})
	return found
}

// joinsSQLAndTable reports whether exprs hold an SQL literal and a call
// naming a millrace table.
func joinsSQLAndTable(exprs []ast.Expr) bool {
	var sql, table bool
	for _, e := range exprs {
		switch e := e.(type) {
		case *ast.BasicLit:
			sql = sql || sqlStatement.MatchString(literal(e))
		case *ast.CallExpr:
			if sel, ok := e.Fun.(*ast.SelectorExpr); ok && tableName.MatchString(sel.Sel.Name) {
				table = true
			}
		}
	}
	return sql && table
}

func literal(l *ast.BasicLit) string {
	if l.Kind != token.STRING {
		return ""
	}
	s, err := strconv.Unquote(l.Value)
	if err != nil {
		return ""
	}
	return s
}

// flatten returns the operands of a chain of + expressions.
func flatten(e ast.Expr) []ast.Expr {
	if b, ok := e.(*ast.BinaryExpr); ok && b.Op == token.ADD {
		return append(flatten(b.X), flatten(b.Y)...)
	}
	if p, ok := e.(*ast.ParenExpr); ok {
		return flatten(p.X)
	}
	return []ast.Expr{e}
}

// The check itself finds both shapes of a query on a millrace table, and
// leaves other SQL and error messages alone.
func TestOwnerCheckFindsQueries(t *testing.T) {
	t.Parallel()
	src := `package p

func f(db DB, t Tables, group string) {
	db.Exec("DELETE FROM public.millrace_inbox WHERE consumer_group = $1", group)
	db.Exec("SELECT count(*) FROM " + t.PoisonTable() + " WHERE id = $1", 1)
	db.Exec(fmt.Sprintf("UPDATE %s SET x = 1", t.QuarantineTable()))
	db.Exec("INSERT INTO orders (id) VALUES ($1)", 1)
	db.Exec("SELECT 1")
	_ = fmt.Errorf("outbox table %s does not exist", t.OutboxTable())
	_ = "table " + t.InboxTable() + " is missing"
}
`
	path := filepath.Join(t.TempDir(), "p.go")
	require.NoError(t, os.WriteFile(path, []byte(src), 0o600))
	found := sqlOnTables(t, path, "p.go")
	require.Equal(t, []string{"p.go:4: a query naming a millrace table", "p.go:5: a query built from a store.Tables name",
		"p.go:6: a query built from a store.Tables name"}, found)
}
