// Package names validates the names millrace passes on to SQL and to brokers
// (topics, consumer groups, schemas), so a hostile or mistyped name is refused
// with a clear error before it reaches a query or a broker.
package names
