package store

import (
	"database/sql"
	"fmt"
)

// eachRow runs scan on every row of a query's result (rows and err, as
// QueryContext returns them) and closes rows. The query's error, a scan's
// and the rows' own read "<what>: <error>".
func eachRow(rows *sql.Rows, err error, what string, scan func(*sql.Rows) error) error {
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	defer rows.Close()
	for rows.Next() {
		if err := scan(rows); err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

// collect is eachRow for a result read into a slice, an element a row
// that scan fills in. The slice is empty, never nil, when no row matches.
func collect[T any](rows *sql.Rows, err error, what string, scan func(*sql.Rows, *T) error) ([]T, error) {
	out := []T{}
	err = eachRow(rows, err, what, func(rows *sql.Rows) error {
		var r T
		if err := scan(rows, &r); err != nil {
			return err
		}
		out = append(out, r)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// collectSet reads a result of one int64 column into a set (eachRow) of
// n values at most.
func collectSet(rows *sql.Rows, err error, what string, n int) (map[int64]bool, error) {
	set := make(map[int64]bool, n)
	err = eachRow(rows, err, what, func(rows *sql.Rows) error {
		var v int64
		err := rows.Scan(&v)
		set[v] = true
		return err
	})
	if err != nil {
		return nil, err
	}
	return set, nil
}

// collectMap reads a result of two columns, a key and its value, into a
// map (eachRow).
func collectMap[K comparable, V any](rows *sql.Rows, err error, what string) (map[K]V, error) {
	m := map[K]V{}
	err = eachRow(rows, err, what, func(rows *sql.Rows) error {
		var k K
		var v V
		err := rows.Scan(&k, &v)
		m[k] = v
		return err
	})
	if err != nil {
		return nil, err
	}
	return m, nil
}
