// Package testkit is the helpers every test shares (test-only: no runtime
// package imports it); its subpackages start private servers, child
// processes and databases for tests.
package testkit
